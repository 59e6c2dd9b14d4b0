"""`group_embedding_column_scope`: which embedding columns share a lookup.

Every `embedding_column` / `shared_embedding_columns` built inside
`with group_embedding_column_scope(name):` records that scope (a frozen
`GroupEmbeddingScope` value); `input_layer` and `GroupEmbeddingFeatures`
then run ONE `group_embedding_lookup_sparse` for all columns of a scope.

A scope is identified by its name. Entering a name again later (a column
factory called twice, a second model_fn trace) adds to the same scope, as
in DeepRec; what is rejected is a name that is already open (nested), or a
name reused with another `params_num_per_group`, because columns of both
would silently land in one lookup with one setting.
"""

import contextlib
import dataclasses
import itertools
import re
import sys
import threading
from typing import Any
from typing import Dict
from typing import Iterator
from typing import List
from typing import Optional

# A scope name becomes a TF name scope of the lookup ops.
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]+$")
_DEFAULT_NAME = "group_embedding_column_scope"


@dataclasses.dataclass(frozen=True)
class GroupEmbeddingScope:
    """The identity of one group of embedding columns.

    Args:
        name: scope name: letters, digits, `_`, `.`, `-`.
        params_num_per_group: at most this many tables per fused lookup op
            (default: no cap), passed to `group_embedding_lookup_sparse`.

    Raises:
        ValueError: empty or invalid name, or `params_num_per_group` not a
            positive int.
    """

    name: str
    params_num_per_group: int = sys.maxsize

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME_PATTERN.match(
                self.name):
            raise ValueError(
                "Invalid `name` of group_embedding_column_scope: "
                f"{self.name!r}; use letters, digits, '_', '.' or '-'.")
        p = self.params_num_per_group
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(
                f"group_embedding_column_scope '{self.name}': "
                "`params_num_per_group` must be a positive int, got "
                f"{p!r}.")

    def get_config(self) -> Dict[str, Any]:
        """Returns the constructor arguments."""
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "GroupEmbeddingScope":
        """Rebuilds a scope from `get_config()`."""
        return cls(**config)


class _Registry(threading.local):
    """Open scopes (a stack per thread) and every name seen so far."""

    def __init__(self):
        self.open: List[GroupEmbeddingScope] = []


_REGISTRY = _Registry()
# Names are process-wide: a scope entered in one thread and reused in
# another with a different setting is still a conflict.
_KNOWN: Dict[str, GroupEmbeddingScope] = {}
_KNOWN_LOCK = threading.Lock()
_DEFAULT_IDS = itertools.count()


def current_scope() -> Optional[GroupEmbeddingScope]:
    """The innermost open scope of this thread, or None outside scopes."""
    return _REGISTRY.open[-1] if _REGISTRY.open else None


def _default_name() -> str:
    with _KNOWN_LOCK:
        while True:
            i = next(_DEFAULT_IDS)
            name = _DEFAULT_NAME if i == 0 else f"{_DEFAULT_NAME}_{i}"
            if name not in _KNOWN:
                return name


def _register(scope: GroupEmbeddingScope) -> None:
    for other in _REGISTRY.open:
        if other.name == scope.name:
            raise ValueError(
                f"group_embedding_column_scope '{scope.name}' is already "
                "open; two scopes cannot share a name. Use another name "
                "for the inner scope.")
    with _KNOWN_LOCK:
        known = _KNOWN.setdefault(scope.name, scope)
    if known != scope:
        raise ValueError(
            f"group_embedding_column_scope '{scope.name}' already exists "
            f"with params_num_per_group={known.params_num_per_group}, got "
            f"{scope.params_num_per_group}; two scopes cannot share a name. "
            "Use another name.")


@contextlib.contextmanager
def group_embedding_column_scope(
        name: Optional[str] = None,
        params_num_per_group: int = sys.maxsize
) -> Iterator[GroupEmbeddingScope]:
    """Groups the embedding columns built inside into one fused lookup.

    Example::

        with ge.feature_column.group_embedding_column_scope("user"):
            age = ge.feature_column.embedding_column(age_ids, 8)
            city = ge.feature_column.embedding_column(city_ids, 8)
        item = ge.feature_column.embedding_column(item_ids, 8)  # stock
        x = ge.feature_column.input_layer(features, [age, city, item])
        # one grouped lookup for age + city, a stock lookup for item.

    Scopes may be nested (the innermost wins) and several scopes may feed
    one `input_layer`; each gets its own grouped lookup.

    Args:
        name: scope name (letters, digits, `_`, `.`, `-`). Default: a new
            unique `group_embedding_column_scope[_N]`.
        params_num_per_group: at most this many tables per fused lookup op
            (default: no cap); see `group_embedding_lookup_sparse`.

    Yields:
        The `GroupEmbeddingScope` the columns record.

    Raises:
        ValueError: invalid name or `params_num_per_group`, a scope of the
            same name already open, or the name already used with another
            `params_num_per_group`.
    """
    scope = GroupEmbeddingScope(
        _default_name() if name is None else name, params_num_per_group)
    _register(scope)
    _REGISTRY.open.append(scope)
    try:
        yield scope
    finally:
        _REGISTRY.open.pop()
