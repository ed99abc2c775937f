"""A real verl tool (verl's `BaseTool`), loaded by verl's agent-loop workers from a tool config."""

from __future__ import annotations

from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse


class WordCountTool(BaseTool):
    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        words = str(parameters.get("text", "")).split()
        return ToolResponse(text=f"{len(words)} words"), 0.0, {}


TOOL_CONFIG = """\
tools:
  - class_name: verl_harness.tools.WordCountTool
    config:
      type: native
    tool_schema:
      type: function
      function:
        name: word_count
        description: Count the words of a text
        parameters:
          type: object
          properties:
            text:
              type: string
              description: the text
          required: [text]
"""
