"""Options of `EmbeddingVariable`: initialisation, admission filter and
eviction policy (DeepRec names and argument order).

All are frozen dataclasses validated in `__post_init__`; each round-trips
through `get_config()` / `from_config()`.
"""

import dataclasses
import enum
import math
import numbers
from typing import Any
from typing import Dict
from typing import Optional
from typing import Union


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_float(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


class _Config:
    """get_config()/from_config() for flat dataclasses."""

    def get_config(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_config(cls, config: Dict[str, Any]):
        return cls(**config)


@dataclasses.dataclass(frozen=True)
class BaseEvictOption(_Config):
    """Base of the eviction policies; at most one applies to a variable."""


@dataclasses.dataclass(frozen=True)
class GlobalStepEvict(BaseEvictOption):
    """Removes keys not seen in the last `steps_to_live` global steps.

    A key is removed when `current_step - version > steps_to_live`, where
    its version is the last step it was seen in training, admitted by the
    filter or not (DeepRec's rule: keys still counting towards admission
    stay), and steps are the optimizer's step counter (`iterations` for
    `ge.optimizers`, `global_step` for `ge.train`).

    Args:
        steps_to_live: positive int, or None (default) for no eviction.

    Raises:
        ValueError: `steps_to_live` is not a positive int or None.
    """

    steps_to_live: Optional[int] = None

    def __post_init__(self):
        s = self.steps_to_live
        if s is not None and (not _is_int(s) or s <= 0):
            raise ValueError("`steps_to_live` must be a positive int or "
                             f"None, got {s!r}.")


@dataclasses.dataclass(frozen=True)
class L2WeightEvict(BaseEvictOption):
    """Removes keys whose half squared L2 norm is below the threshold.

    A key is removed when `0.5 * sum(v^2) < l2_weight_threshold`, DeepRec's
    rule (e.g. with threshold 0.9 a row of three 0.7s, 0.735, goes; three
    0.8s, 0.96, stay).

    Args:
        l2_weight_threshold: float; negative (default -1.0) disables it.

    Raises:
        ValueError: `l2_weight_threshold` is not a number.
    """

    l2_weight_threshold: float = -1.0

    def __post_init__(self):
        if not _is_float(self.l2_weight_threshold):
            raise ValueError("`l2_weight_threshold` must be a float, got "
                             f"{self.l2_weight_threshold!r}.")


@dataclasses.dataclass(frozen=True)
class BaseFilterOption(_Config):
    """Base of the admission filters; at most one applies to a variable."""


@dataclasses.dataclass(frozen=True)
class CounterFilter(BaseFilterOption):
    """Admits a key only after `filter_freq` occurrences in training.

    Occurrences are counted per training lookup, duplicates in a batch
    included, after the lookup has read (DeepRec's order): a key reads
    `InitializerOption.default_value_no_permission` for its first
    `filter_freq` lookups and its real value from lookup `filter_freq + 1`
    on. The optimizer step of the lookup that brings the count to
    `filter_freq` already updates the real value; earlier steps do not.
    Every key seen is stored (with its count) from its first lookup.

    Args:
        filter_freq: int >= 0, default 0 (every key admitted).

    Raises:
        ValueError: `filter_freq` is not an int >= 0.
    """

    filter_freq: int = 0

    def __post_init__(self):
        if not _is_int(self.filter_freq) or self.filter_freq < 0:
            raise ValueError("`filter_freq` must be an int >= 0, got "
                             f"{self.filter_freq!r}.")


SUPPORTED_COUNTER_TYPES = ("uint8", "uint16", "uint32", "uint64")
_SIGNED_COUNTER_TYPES = ("int8", "int16", "int32", "int64")


@dataclasses.dataclass(frozen=True)
class CBFFilter(BaseFilterOption):
    """Admits a key after `filter_freq` occurrences, counted in a counting
    Bloom filter (DeepRec's `tf.CBFFilter`).

    Unlike `CounterFilter`, a key is not stored until it is admitted: its
    occurrences are counted in `num_counters` counters of `counter_type`,
    `num_hashes` per key, sized for `max_element_size` distinct keys at
    `false_positive_probability`: `num_counters = ceil(-n ln p / (ln
    2)^2)`, `num_hashes = ceil(-log2 p)` (= `num_counters / n * ln 2`).
    Up to 256 MiB the counters are one array, allocated with the table
    whatever the number of keys seen (e.g. n = 10**6, p = 0.01: 9.6
    million counters, 77 MB of uint64 or 9.6 MB of uint8); a larger
    filter (DeepRec's model zoo asks for n = 2**30: 82 GB of uint64)
    keeps only the counters that keys have raised, in a map, so its
    memory follows the keys counted (about `num_hashes` entries each),
    with the same counts and admissions. A key's count is the least of its
    counters; counters stop at `filter_freq`. Reads and updates follow
    `CounterFilter`: `default_value_no_permission` for the first
    `filter_freq` lookups, the real row from lookup `filter_freq + 1` on.

    False positives: other keys sharing all of a key's counters make its
    count too high, never too low, so a key may be admitted early (at its
    first lookup at worst), never late. While at most `max_element_size`
    keys have been counted this happens to about a
    `false_positive_probability` share of new keys; past that the share
    grows. Counts of keys not admitted yet are not checkpointed (nor in
    DeepRec); `get_frequency` reads 0 for them.

    Args:
        filter_freq: occurrences needed, int >= 1 and below the largest
            value of `counter_type`.
        max_element_size: distinct keys the filter is sized for, int >= 1.
        false_positive_probability: float in (0, 1).
        counter_type: tf.uint8, tf.uint16, tf.uint32 or tf.uint64
            (default), or its name; a signed integer type counts in uint64
            as in DeepRec (whose model zoo passes tf.int64).

    Raises:
        ValueError: an argument out of its range.
    """

    filter_freq: int = 0
    max_element_size: int = 0
    false_positive_probability: float = -1.0
    counter_type: Any = "uint64"

    def __post_init__(self):
        kind = getattr(self.counter_type, "name", self.counter_type)
        if kind in _SIGNED_COUNTER_TYPES:
            # DeepRec counts in uint64 for any type but the unsigned ones,
            # and its model zoo passes counter_type=tf.int64.
            kind = "uint64"
        if kind not in SUPPORTED_COUNTER_TYPES:
            raise ValueError("`counter_type` must be one of "
                             f"{', '.join(SUPPORTED_COUNTER_TYPES)}, got "
                             f"{self.counter_type!r}.")
        object.__setattr__(self, "counter_type", kind)
        bits = 8 * self.counter_bytes
        if (not _is_int(self.filter_freq) or self.filter_freq < 1
                or self.filter_freq >= 2 ** bits - 1 and bits < 64):
            raise ValueError("`filter_freq` must be an int in [1, "
                             f"{2 ** bits - 2}] for counter_type {kind}, "
                             f"got {self.filter_freq!r}.")
        if not _is_int(self.max_element_size) or self.max_element_size < 1:
            raise ValueError("`max_element_size` must be an int >= 1, got "
                             f"{self.max_element_size!r}.")
        p = self.false_positive_probability
        if not _is_float(p) or not 0.0 < p < 1.0:
            raise ValueError("`false_positive_probability` must be in "
                             f"(0, 1), got {p!r}.")

    @property
    def counter_bytes(self) -> int:
        return {"uint8": 1, "uint16": 2, "uint32": 4,
                "uint64": 8}[self.counter_type]

    @property
    def num_counters(self) -> int:
        p = self.false_positive_probability
        return math.ceil(-self.max_element_size * math.log(p)
                         / math.log(2) ** 2)

    @property
    def num_hashes(self) -> int:
        return max(1, math.ceil(-math.log2(self.false_positive_probability)))


@dataclasses.dataclass(frozen=True)
class InitializerOption(_Config):
    """How new keys are initialised.

    A `[default_value_dim, D]` matrix is drawn once from `initializer`; a
    new key starts from row `key mod default_value_dim` (floor modulo, so
    negative keys work too).

    Args:
        initializer: a Keras/TF initializer or callable `(shape, dtype)`;
            None (default) for truncated normal with stddev `1/sqrt(D)`.
        default_value_dim: rows of the default matrix, int >= 1
            (default 4096).
        default_value_no_permission: value read by keys a `CounterFilter`
            has not admitted yet (default 0.0).

    Raises:
        ValueError: bad `default_value_dim` or
            `default_value_no_permission`.
        TypeError: `initializer` is not callable.
    """

    initializer: Any = None
    default_value_dim: int = 4096
    default_value_no_permission: float = 0.0

    def __post_init__(self):
        if self.initializer is not None and not callable(self.initializer):
            raise TypeError("`initializer` must be callable or None, got "
                            f"{type(self.initializer).__name__}.")
        if not _is_int(self.default_value_dim) or self.default_value_dim < 1:
            raise ValueError("`default_value_dim` must be an int >= 1, got "
                             f"{self.default_value_dim!r}.")
        if not _is_float(self.default_value_no_permission):
            raise ValueError("`default_value_no_permission` must be a float, "
                             f"got {self.default_value_no_permission!r}.")

    def get_config(self) -> Dict[str, Any]:
        import keras  # local: keras is heavy and only needed here

        init = self.initializer
        if init is not None:
            init = keras.initializers.serialize(keras.initializers.get(init))
        return {"initializer": init,
                "default_value_dim": self.default_value_dim,
                "default_value_no_permission":
                    self.default_value_no_permission}

    @classmethod
    def from_config(cls, config: Dict[str, Any]):
        import keras

        config = dict(config)
        if config.get("initializer") is not None:
            config["initializer"] = keras.initializers.deserialize(
                config["initializer"])
        return cls(**config)


class StorageType(enum.IntEnum):
    """DeepRec's `config_pb2.StorageType` names (multi-tier EV storage).

    `DRAM` (and `DEFAULT`, which means DRAM), `DRAM_SSDHASH` (the hottest
    keys in DRAM, the rest in a file on disk), `SSDHASH` (every key on
    disk between steps), `HBM` (the table in GPU memory) and `HBM_DRAM`
    (the hottest keys in GPU memory, the rest in host memory) exist here.
    The other names are listed so that a script
    naming them gets `StorageOption`'s clear error, not an AttributeError.
    """

    DEFAULT = 0
    DRAM = 1
    PMEM_MEMKIND = 2
    PMEM_LIBPMEM = 3
    SSDHASH = 4
    LEVELDB = 5
    HBM = 6
    DRAM_PMEM = 11
    DRAM_SSDHASH = 12
    HBM_DRAM = 13
    DRAM_LEVELDB = 14
    DRAM_PMEM_SSDHASH = 101
    HBM_DRAM_SSDHASH = 102


class CacheStrategy(enum.IntEnum):
    """DeepRec's `config_pb2.CacheStrategy`: which DRAM rows go to disk.

    `LFU` spills the keys seen least often (lowest frequency), `LRU` the
    keys seen longest ago (oldest version, the last step a key was looked
    up in training); ties go by key.
    """

    LRU = 0
    LFU = 1


SUPPORTED_STORAGE_TYPES = (StorageType.DEFAULT, StorageType.DRAM,
                           StorageType.DRAM_SSDHASH, StorageType.SSDHASH,
                           StorageType.HBM, StorageType.HBM_DRAM)
SSD_STORAGE_TYPES = (StorageType.DRAM_SSDHASH, StorageType.SSDHASH)
# Tables in GPU memory (the CUDA core's EV table, ops/cuda/ev_table.h).
HBM_STORAGE_TYPES = (StorageType.HBM, StorageType.HBM_DRAM)
# Tiers with a byte budget in `storage_size[0]` and a `cache_strategy`.
_SIZED_STORAGE_TYPES = (StorageType.DRAM_SSDHASH,) + HBM_STORAGE_TYPES
# DeepRec's default `storage_size`: one DRAM tier of 1 GiB.
DEFAULT_DRAM_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class StorageOption(_Config):
    """Where an EV keeps its rows (DeepRec's `tf.StorageOption`).

    With `DRAM_SSDHASH`, the hottest keys keep their rows in DRAM within
    `storage_size[0]` bytes and the others live in one file under
    `storage_path` (an append-only file of checksummed records: key,
    frequency, version, value and every optimizer slot). Lookups and
    updates bring a key's row back to DRAM; the coldest rows (by
    `cache_strategy`) go to disk when the DRAM tier is over budget. With
    `SSDHASH`, every row goes back to disk after each op. Both tiers
    together are one table: `size()`, filters, eviction, export and
    checkpoints see every key, and a key's row, slots, frequency and
    version are the same whichever tier holds it.

    Args:
        storage_type: `StorageType.DRAM` (default), `DEFAULT`,
            `DRAM_SSDHASH`, `SSDHASH`, `HBM` or `HBM_DRAM`; an int or a
            `config_pb2.StorageType` value is accepted too.
        storage_path: the folder of the disk tier (DRAM_SSDHASH and
            SSDHASH only, required there); created if missing, owned by
            one EmbeddingVariable of the process. Processes may share it
            (the workers of one host): each EV file is locked by its
            process, and another process of the same EV name takes the
            next free name (`name.1.tier`, ...).
        storage_size: DRAM_SSDHASH: `[dram_bytes]`; HBM, HBM_DRAM:
            `[hbm_bytes]` (DeepRec's per-tier list; default `[2**30]`,
            DeepRec's). DRAM_SSDHASH's budget covers the DRAM rows with
            their slots AND the disk tier's in-memory index (12 bytes a
            slot of an open-addressing table, 15 to 19 bytes a key on
            disk); it must hold one row with its optimizer slots. One
            op's keys may exceed it until the next op on the EV.
        cache_strategy: DRAM_SSDHASH, HBM, HBM_DRAM: `CacheStrategy.LFU`
            (default, DeepRec's) or `LRU`.

    With `HBM`, the EV's table lives in GPU memory (the CUDA core's hash
    table): `storage_size[0]` bytes (default `[2**30]`) bound the table
    with room for two optimizer slots per key, and when a bucket of it is
    full a new key evicts its least valuable key by `cache_strategy`
    (default LFU), dropping it. `HBM_DRAM` is the same table over a
    host-memory tier: a key the full table gives up moves there with its
    row, slots, frequency and version, and moves back before any lookup,
    update or export reads it, so nothing is dropped (`storage_size[0]`
    bounds the GPU table; the host tier holds the rest, unbounded). Both need
    a GPU that TF sees: creating one elsewhere raises RuntimeError naming
    the EV (there is no CPU fallback); CI runs HBM EVs on the core's host
    stand-in (`GROUP_EMBEDDING_HBM_ON_HOST`, ops/config.py).

    Note: the disk tier is a cache of one process, not a checkpoint: a
    restarted job restores from its checkpoint, and the file is rewritten
    from scratch when the EV is created.

    Raises:
        NotImplementedError: a storage type other than DRAM, DEFAULT,
            DRAM_SSDHASH, SSDHASH, HBM or HBM_DRAM, or a storage path or
            size for DRAM (a storage path for HBM / HBM_DRAM).
        ValueError: an unknown storage type, a missing `storage_path`, a
            bad `storage_size` or `cache_strategy`.
    """

    storage_type: Any = StorageType.DRAM
    storage_path: Optional[str] = None
    # A list (DeepRec's), left out of the hash: feature columns holding
    # this option are dict keys.
    storage_size: Any = dataclasses.field(default=None, hash=False)
    cache_strategy: Any = None

    def __post_init__(self):
        try:
            kind = StorageType(int(self.storage_type))
        except (TypeError, ValueError):
            raise ValueError("`storage_type` must be a StorageType, got "
                             f"{self.storage_type!r}.") from None
        if kind not in SUPPORTED_STORAGE_TYPES:
            raise NotImplementedError(
                f"StorageOption: storage_type {kind.name} is not supported "
                "by group_embedding; use StorageType.DRAM, DRAM_SSDHASH, "
                "SSDHASH, HBM or HBM_DRAM.")
        object.__setattr__(self, "storage_type", kind)
        if kind in HBM_STORAGE_TYPES:
            if self.storage_path is not None:
                raise NotImplementedError(
                    f"StorageOption: {kind.name} keeps no disk tier, so "
                    "`storage_path` names nothing; leave it None.")
            self._set_budget(kind)
            return
        if kind not in SSD_STORAGE_TYPES:
            if self.storage_path is not None or self.storage_size is not None:
                raise NotImplementedError(
                    "StorageOption: `storage_path` / `storage_size` "
                    f"configure a disk tier, which {kind.name} does not "
                    "have; leave them None or use DRAM_SSDHASH.")
            return
        if not isinstance(self.storage_path, str) or not self.storage_path:
            raise ValueError(f"StorageOption: {kind.name} needs "
                             "`storage_path`, a folder, got "
                             f"{self.storage_path!r}.")
        if kind == StorageType.SSDHASH:
            if self.storage_size is not None:
                raise NotImplementedError(
                    "StorageOption: SSDHASH keeps no DRAM tier, so "
                    "`storage_size` sizes nothing; leave it None or use "
                    "DRAM_SSDHASH.")
            if self.cache_strategy is not None:
                raise NotImplementedError(
                    "StorageOption: SSDHASH keeps no DRAM tier, so "
                    "`cache_strategy` chooses nothing; leave it None.")
            return
        self._set_budget(kind)

    def _set_budget(self, kind: StorageType) -> None:
        """Checks and normalises `storage_size` ([bytes] of the first
        tier, DRAM for DRAM_SSDHASH, HBM for HBM / HBM_DRAM) and
        `cache_strategy`."""
        size = self.storage_size
        if size is None:
            size = [DEFAULT_DRAM_BYTES]
        tier = "dram_bytes" if kind == StorageType.DRAM_SSDHASH \
            else "hbm_bytes"
        if (not isinstance(size, (list, tuple)) or len(size) != 1
                or not _is_int(size[0]) or size[0] < 1):
            raise ValueError(f"StorageOption: `storage_size` must be "
                             f"[{tier}] with {tier} >= 1 for {kind.name}, "
                             f"got {self.storage_size!r}.")
        object.__setattr__(self, "storage_size", [int(size[0])])
        strategy = self.cache_strategy
        if strategy is None:
            strategy = CacheStrategy.LFU
        try:
            strategy = CacheStrategy(int(strategy))
        except (TypeError, ValueError):
            raise ValueError("StorageOption: `cache_strategy` must be "
                             "CacheStrategy.LFU or LRU, got "
                             f"{self.cache_strategy!r}.") from None
        object.__setattr__(self, "cache_strategy", strategy)

    def is_tiered(self) -> bool:
        """Whether rows may live on disk (DRAM_SSDHASH or SSDHASH)."""
        return self.storage_type in SSD_STORAGE_TYPES

    def is_hbm(self) -> bool:
        """Whether the table lives in GPU memory (HBM or HBM_DRAM)."""
        return self.storage_type in HBM_STORAGE_TYPES

    def hbm_bytes(self) -> int:
        """The GPU memory budget of an HBM / HBM_DRAM table (0 else)."""
        if not self.is_hbm():
            return 0
        return int(self.storage_size[0])

    def dram_bytes(self) -> int:
        """The DRAM tier's budget in bytes (0 for SSDHASH and DRAM)."""
        if self.storage_type != StorageType.DRAM_SSDHASH:
            return 0
        return int(self.storage_size[0])

    def get_config(self) -> Dict[str, Any]:
        config: Dict[str, Any] = {"storage_type": int(self.storage_type)}
        if self.is_tiered() or self.is_hbm():
            if self.is_tiered():
                config["storage_path"] = self.storage_path
            config["storage_size"] = self.storage_size
            config["cache_strategy"] = (
                None if self.cache_strategy is None
                else int(self.cache_strategy))
        return config


_EVICT_CLASSES: Dict[str, Any] = {"GlobalStepEvict": GlobalStepEvict,
                                  "L2WeightEvict": L2WeightEvict}
_FILTER_CLASSES: Dict[str, Any] = {"CounterFilter": CounterFilter,
                                   "CBFFilter": CBFFilter}


@dataclasses.dataclass(frozen=True)
class EmbeddingVariableOption(_Config):
    """All options of one `EmbeddingVariable`.

    Args:
        evict_option: None (default), a `GlobalStepEvict` or an
            `L2WeightEvict`. Eviction runs at checkpoint save and on
            `EmbeddingVariable.evict()`.
        filter_option: None (default), a `CounterFilter` or a `CBFFilter`.
        init_option: an `InitializerOption` (default `InitializerOption()`).
        storage_option: a `StorageOption` (default DRAM; DRAM_SSDHASH and
            SSDHASH add a disk tier).

    Raises:
        ValueError: several eviction policies (a list or tuple of them);
            they cannot be combined.
        TypeError: an option of the wrong class.
    """

    evict_option: Optional[Union[GlobalStepEvict, L2WeightEvict]] = None
    filter_option: Optional[Union[CounterFilter, CBFFilter]] = None
    init_option: InitializerOption = dataclasses.field(
        default_factory=InitializerOption)
    storage_option: StorageOption = dataclasses.field(
        default_factory=StorageOption)

    def __post_init__(self):
        evict = self.evict_option
        if isinstance(evict, (list, tuple)):
            if len(evict) > 1:
                raise ValueError(
                    "`evict_option` cannot combine eviction policies, got "
                    f"{[type(e).__name__ for e in evict]}; use one of "
                    "GlobalStepEvict or L2WeightEvict.")
            evict = evict[0] if evict else None
            object.__setattr__(self, "evict_option", evict)
        if evict is not None and not isinstance(evict, BaseEvictOption):
            raise TypeError("`evict_option` must be GlobalStepEvict, "
                            "L2WeightEvict or None, got "
                            f"{type(evict).__name__}.")
        if (self.filter_option is not None
                and not isinstance(self.filter_option, BaseFilterOption)):
            raise TypeError("`filter_option` must be a CounterFilter, "
                            "CBFFilter or None, got "
                            f"{type(self.filter_option).__name__}.")
        if not isinstance(self.storage_option, StorageOption):
            raise TypeError("`storage_option` must be a StorageOption, got "
                            f"{type(self.storage_option).__name__}.")
        if not isinstance(self.init_option, InitializerOption):
            raise TypeError("`init_option` must be an InitializerOption, got "
                            f"{type(self.init_option).__name__}.")

    def get_config(self) -> Dict[str, Any]:
        evict = self.evict_option
        return {
            "evict_option": None if evict is None else {
                "class_name": type(evict).__name__,
                "config": evict.get_config()},
            "filter_option": (None if self.filter_option is None else {
                "class_name": type(self.filter_option).__name__,
                "config": self.filter_option.get_config()}),
            "init_option": self.init_option.get_config(),
            "storage_option": self.storage_option.get_config(),
        }

    @classmethod
    def from_config(cls, config: Dict[str, Any]):
        evict = config.get("evict_option")
        if evict is not None:
            evict = _EVICT_CLASSES[evict["class_name"]].from_config(
                evict["config"])
        filt = config.get("filter_option")
        if filt is not None:
            # Configs written before CBFFilter hold a bare CounterFilter.
            filt = (_FILTER_CLASSES[filt["class_name"]].from_config(
                filt["config"]) if "class_name" in filt
                else CounterFilter.from_config(filt))
        return cls(
            evict_option=evict,
            filter_option=filt,
            init_option=InitializerOption.from_config(
                config.get("init_option", {})),
            storage_option=StorageOption.from_config(
                config.get("storage_option", {})))
