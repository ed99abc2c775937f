"""Check JSON documents against a server's own wire definitions, inside that server's venv.

    python validate.py sglang|vllm IN.json OUT.json

IN.json: `{"documents": [{"label", "kind", "body"}], "builds": [{"label", "kind", "spec"}]}`.
Each document is validated by the definition its kind names (`KINDS`): the pydantic models of
the OpenAI-compatible routes (vLLM `vllm.entrypoints.openai.*.protocol` and the token-in/out
`GenerateRequest`; SGLang `sglang.srt.entrypoints.openai.protocol`), and for SGLang's
`/generate` its generated JSON contract (`sglang.api.v1.api_types`, which the server's schema
gate applies) plus the fields of `GenerateReqInput` (the dataclass FastAPI fills from the
body) and the `meta_info` keys the tokenizer manager sets, both read from the installed
source. Validation is strict where the definitions are lenient: a key no model declares is
reported (`extra="allow"` models would accept anything, and FastAPI drops what a dataclass
does not declare). Each build is a document made BY the definitions from a spec (values the
test chose), encoded as the server encodes it, so the test can feed it to the proxy's parser.
OUT.json: `{"problems": {label: [text]}, "built": {label: body}}`.

SGLang's package `__init__` loads its runtime (CUDA builds of torch, triton, torchvision);
the definition modules do not need it, so `sglang` is registered as a bare package first.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

Json = Any
Check = Callable[[Json], list[str]]


def _bare_sglang() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations is not None
    root = Path(next(iter(spec.submodule_search_locations)))
    package = types.ModuleType("sglang")
    package.__path__ = [str(root)]
    sys.modules["sglang"] = package
    return root


# --- strict pydantic validation -------------------------------------------------------------


def _undeclared(value: Any, raw: Any, path: str) -> Iterator[str]:
    """Keys of `raw` that the model instance it was validated into does not declare."""
    from pydantic import BaseModel

    if isinstance(value, BaseModel) and isinstance(raw, dict):
        fields = type(value).model_fields
        names = {(field.alias or name): name for name, field in fields.items()}
        names.update({name: name for name in fields})
        for key, item in raw.items():
            if key not in names:
                yield f"{path}.{key}: not declared by {type(value).__name__}"
            else:
                yield from _undeclared(getattr(value, names[key]), item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)) and isinstance(raw, list):
        for i, (item, raw_item) in enumerate(zip(value, raw, strict=False)):
            yield from _undeclared(item, raw_item, f"{path}[{i}]")
    elif isinstance(value, dict) and isinstance(raw, dict):
        for key, raw_item in raw.items():
            if key in value:
                yield from _undeclared(value[key], raw_item, f"{path}.{key}")


def pydantic_check(model: Any) -> Check:
    """Validate as the server's FastAPI route does (from JSON text), then strictly."""
    from pydantic import ValidationError

    def check(body: Json) -> list[str]:
        try:
            value = model.model_validate_json(json.dumps(body))
        except ValidationError as exc:
            return [f"{model.__name__}: {exc}"]
        return list(_undeclared(value, body, model.__name__))

    return check


# --- SGLang /generate: the contract, GenerateReqInput's fields, the manager's meta_info -----


def _dataclass_fields(source: Path, name: str) -> set[str]:
    """The annotated fields of a dataclass in a source file (its module needs the runtime)."""
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            }
    raise LookupError(f"no class {name} in {source}")


def _meta_info_keys(sources: list[Path]) -> set[str]:
    """Every key the server writes into a `meta_info` dict: `meta_info[...]["k"] = ...`,
    `meta_info = {"k": ...}`, `meta_info.update({"k": ...})`, and the dicts the time-stats
    helpers build for it (`meta_info` / `meta_data` locals)."""
    keys: set[str] = set()
    holders = ("meta_info", "meta_data")

    def names(node: ast.AST) -> str:
        return ast.unparse(node)

    def literal_keys(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Dict):
            return {k.value for k in node.keys if isinstance(k, ast.Constant)}
        return set()

    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if (
                        isinstance(target, ast.Subscript)
                        and any(h in names(target.value) for h in holders)
                        and isinstance(target.slice, ast.Constant)
                    ):
                        keys.add(target.slice.value)
                    if isinstance(target, ast.Name) and target.id in holders:
                        keys |= literal_keys(node.value)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "update"
                and names(node.func.value) in holders
                and node.args
            ):
                keys |= literal_keys(node.args[0])
    return {k for k in keys if isinstance(k, str)}


class SGLang:
    """The checks for SGLang 0.5's definitions."""

    def __init__(self) -> None:
        root = _bare_sglang()
        self.api = importlib.import_module("sglang.api.v1.api_types")
        self.contract = importlib.import_module("sglang.srt.entrypoints.api_contract")
        self.openai = importlib.import_module("sglang.srt.entrypoints.openai.protocol")
        srt = root / "srt"
        self.request_fields = _dataclass_fields(
            srt / "managers" / "io_struct.py", "GenerateReqInput"
        )
        self.meta_keys = _meta_info_keys(
            [
                srt / "managers" / "tokenizer_manager.py",
                srt / "observability" / "req_time_stats.py",
                srt / "utils" / "weight_versions.py",
            ]
        ) | set(self.api.GenerateMetaInfo.__struct_fields__)
        p = self.openai
        self.kinds: dict[str, Check] = {
            "generate.request": self.generate_request,
            "generate.response": self.generate_response,
            "generate.stream_error": self.stream_error,
            "completion.request": pydantic_check(p.CompletionRequest),
            "completion.response": pydantic_check(p.CompletionResponse),
            "completion.chunk": pydantic_check(p.CompletionStreamResponse),
            "chat.request": pydantic_check(p.ChatCompletionRequest),
            "chat.response": pydantic_check(p.ChatCompletionResponse),
            "chat.chunk": pydantic_check(p.ChatCompletionStreamResponse),
            "openai.error": pydantic_check(p.ErrorResponse),
        }

    def generate_request(self, body: Json) -> list[str]:
        problems = []
        if (error := self.contract.generate_contract_error(body)) is not None:
            problems.append(f"schema gate: {error}")
        if isinstance(body, dict):
            extra = sorted(set(body) - self.request_fields)
            problems += [f"{key}: not a field of GenerateReqInput" for key in extra]
        return problems

    def generate_response(self, body: Json) -> list[str]:
        problems = []
        items = body if isinstance(body, list) else [body]
        declared = set(self.api.GenerateResponse.__struct_fields__)
        for i, item in enumerate(items):
            where = f"[{i}]" if isinstance(body, list) else ""
            try:
                self.api.GenerateResponse.from_json_value(item)
            except self.api.JsonContractError as exc:
                problems.append(f"{where}GenerateResponse: {exc}")
                continue
            problems += [f"{where}.{k}: not a GenerateResponse field" for k in set(item) - declared]
            meta = item.get("meta_info") or {}
            problems += [
                f"{where}.meta_info.{k}: set nowhere by the server"
                for k in sorted(set(meta) - self.meta_keys)
            ]
        return problems

    def stream_error(self, body: Json) -> list[str]:
        try:
            self.api.GenerateStreamError.from_json_value(body)
        except self.api.JsonContractError as exc:
            return [f"GenerateStreamError: {exc}"]
        return [f"{k}: not a GenerateStreamError field" for k in set(body) - {"error", "index"}]

    def build(self, kind: str, spec: Json) -> Json:
        """`generate.response`: a GenerateResponse from the spec, encoded by the contract."""
        api = self.api
        assert kind == "generate.response", kind
        finish = spec["finish"]
        reason = {
            "stop": lambda: api.FinishStop(matched=finish.get("matched")),
            "length": lambda: api.FinishLength(length=finish.get("length")),
            "abort": lambda: api.FinishAbort(message=finish.get("message")),
            None: lambda: None,
        }[finish.get("type")]()
        entries = [
            api.LogprobEntry(logprob=lp, token_id=t, text=None)
            for lp, t in zip(spec["logprobs"], spec["output_ids"], strict=True)
        ]
        meta = api.GenerateMetaInfo(
            id=spec["id"],
            prompt_tokens=spec["prompt_tokens"],
            completion_tokens=spec["completion_tokens"],
            cached_tokens=spec.get("cached_tokens", 0),
            finish_reason=reason,
            output_token_logprobs=entries,
            weight_version=spec.get("weight_version"),
        )
        response = api.GenerateResponse(
            text=spec["text"],
            output_ids=spec["output_ids"],
            meta_info=meta,
            index=spec.get("index"),
        )
        return response.to_json_value()


class VLLM:
    """The checks for the installed vLLM's protocol models."""

    def __init__(self) -> None:
        completion = importlib.import_module("vllm.entrypoints.openai.completion.protocol")
        chat = importlib.import_module("vllm.entrypoints.openai.chat_completion.protocol")
        engine = importlib.import_module("vllm.entrypoints.serve.engine.protocol")
        tito = importlib.import_module("vllm.entrypoints.scale_out.token_in_token_out.protocol")
        self.completion, self.tito = completion, tito
        self.kinds: dict[str, Check] = {
            "completion.request": pydantic_check(completion.CompletionRequest),
            "completion.response": pydantic_check(completion.CompletionResponse),
            "completion.chunk": pydantic_check(completion.CompletionStreamResponse),
            "chat.request": pydantic_check(chat.ChatCompletionRequest),
            "chat.response": pydantic_check(chat.ChatCompletionResponse),
            "chat.chunk": pydantic_check(chat.ChatCompletionStreamResponse),
            "openai.error": pydantic_check(engine.ErrorResponse),
            "generate.request": pydantic_check(tito.GenerateRequest),
            "generate.response": pydantic_check(tito.GenerateTokensResponse),
            "generate.chunk": pydantic_check(tito.GenerateTokensStreamResponse),
        }

    def build(self, kind: str, spec: Json) -> Json:
        """A response made by the models from the spec, dumped as the server dumps it."""
        usage = {"prompt_tokens": spec["prompt_tokens"], "completion_tokens": len(spec["ids"])}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if kind == "completion.response":
            c = self.completion
            choice = c.CompletionResponseChoice(
                index=0,
                text=spec["text"],
                token_ids=spec["ids"],
                prompt_token_ids=spec["prompt_ids"],
                logprobs=c.CompletionLogProbs(
                    token_logprobs=spec["logprobs"], tokens=spec["tokens"]
                ),
                finish_reason=spec["finish_reason"],
                stop_reason=spec["stop_reason"],
            )
            response = c.CompletionResponse(id=spec["id"], model="m", choices=[choice], usage=usage)
        else:
            assert kind == "generate.response", kind
            t = self.tito
            choice = t.GenerateTokensChoice(
                index=0,
                token_ids=spec["ids"],
                finish_reason=spec["finish_reason"],
                stop_reason=spec["stop_reason"],
                logprobs=t.GenerateLogProbs(
                    content=[
                        t.GenerateLogProbsContent(token_id=i, logprob=lp)
                        for i, lp in zip(spec["ids"], spec["logprobs"], strict=True)
                    ]
                ),
            )
            response = t.GenerateTokensResponse(
                request_id=spec["id"],
                choices=[choice],
                usage=usage,
                prompt_token_ids=spec["prompt_ids"],
            )
        return json.loads(response.model_dump_json(exclude_unset=True))


def main(argv: list[str]) -> int:
    dialect, source, target = argv
    checker: SGLang | VLLM = SGLang() if dialect == "sglang" else VLLM()
    work = json.loads(Path(source).read_text())
    problems: dict[str, list[str]] = {}
    for document in work.get("documents", []):
        check = checker.kinds[document["kind"]]
        problems[document["label"]] = check(document["body"])
    built = {b["label"]: checker.build(b["kind"], b["spec"]) for b in work.get("builds", [])}
    Path(target).write_text(json.dumps({"problems": problems, "built": built}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
