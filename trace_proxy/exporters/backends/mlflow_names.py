"""Names from requests as MLflow can hold them, and find them again.

A project (the MLflow experiment), an experiment (the run's name) and label names (trace tags)
come from requests: up to 256 characters of anything but CR, LF and TAB (labels: any string).
MLflow 3.17 is stricter in three places, and each used to stall the backend, the same batch
failing on every retry:

- Search filters have no escapes. `SearchUtils.parse_search_filter` tokenises with sqlparse and
  keeps what lies between a value's first and last character, so a value can be quoted with
  `'` or `"` only if it does not contain that quote, and not at all if it contains both.
  `literal` quotes a value and checks the result with MLflow's own parser. A run whose name
  cannot be searched for is found by a tag holding a hash of its name (`NAME_DIGEST_TAG`,
  which every run made here carries).
- Stored names are bounded: experiment names to 500 characters (MLflow refuses more), run names
  to 250 (the run table's column: PostgreSQL and MySQL refuse more, sqlite does not check).
  The file store finds an experiment with the filter `name = '<name>'`, written unquoted, so
  there a name with `'` cannot be found, nor created (MLflow looks it up first), and one such
  as `a' AND name LIKE '%` is read as another filter. Those names are stored as a `substitute`.
- Tag keys are letters, digits and `_-. :/`, at most 250 characters (`label_tag`).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.utils.search_utils import SearchUtils

from trace_proxy.store.names import digest

NAME_DIGEST_TAG = "trace_proxy.name_digest"  # on runs: digest(name) of the name they stand for
PROJECT_TAG = "trace_proxy.project"  # on an experiment named by a substitute: the project
MAX_TAG_KEY = 250
MAX_EXPERIMENT_TAG_VALUE = 20_000
_TAG_KEY = re.compile(r"[/\w.\- :]*")  # mlflow.utils.validation.validate_param_and_metric_name
_NOT_IN_TAG_KEY = re.compile(r"[^\w.\- :]")  # and no `/`: a key with one may not be "unique"
# MLflow's parser of run search filters (untyped): clauses of {"type", "key", "comparator", "value"}
_parse_filter: Callable[[str], list[dict[str, Any]]] = SearchUtils.parse_search_filter
_MARK = "~"
_SHORT_DIGEST = 8  # hex digits telling apart label names that were changed the same way


def literal(value: str) -> str | None:
    """`value` as a string of MLflow's search filters (`attributes.run_name = <literal>`), or
    None when no quoting reads back as `value`."""
    for quote in ("'", '"'):
        if quote in value:
            continue
        quoted = quote + value + quote
        try:
            clauses = _parse_filter(f"attributes.run_name = {quoted}")
        except MlflowException:
            continue
        if len(clauses) == 1 and clauses[0].get("value") == value:
            return quoted
    return None


def substitute(name: str, limit: int) -> str:
    """A name MLflow can store and look up standing for `name`: `'` written `_`, cut to fit
    `limit`, then `~` and a hash of the whole name, so two names never share one."""
    mark = _MARK + digest(name)
    return name.replace("'", "_")[: limit - len(mark)] + mark


def label_tag(name: str) -> str:
    """The trace tag of label `name`: `label.<name>`, or, when MLflow would refuse that key,
    the name with other characters as `_`, cut, and a short hash of it."""
    key = "label." + name
    if len(key) <= MAX_TAG_KEY and _TAG_KEY.fullmatch(key) and posixpath.normpath(key) == key:
        return key
    tail = "." + digest(name)[:_SHORT_DIGEST]
    cleaned = _NOT_IN_TAG_KEY.sub("_", name)
    return "label." + cleaned[: MAX_TAG_KEY - len("label.") - len(tail)] + tail


__all__ = ["NAME_DIGEST_TAG", "PROJECT_TAG", "label_tag", "literal", "substitute"]
