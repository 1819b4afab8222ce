"""Back-pressure on a slow secondary tier (vLLM 0.33:
``vllm/v1/kv_offload/tiering/backpressure.py``).

Every block the GPU offloads lands in the CPU tier and is then *cascaded* to each secondary
tier (a disk, an object store). When that tier writes slower than blocks arrive, its queue
grows, the CPU blocks being read for it stay pinned, and the CPU tier runs out of room for
new stores. vLLM 0.33 lets a tier shed load instead: a **detector** watches how long each
finished cascade took per MiB and says "under pressure"; a **policy** then decides which
cascades to drop. A dropped cascade only costs a future disk hit -- the block is still in
the CPU tier -- so dropping is always safe; waiting is not.

The default detector, :class:`EMABackpressureDetector`, keeps an exponential moving
average of seconds per MiB:

* the first ``warmup_completions`` samples only seed the average (their mean): no verdict
  from a cold start;
* above ``high_water_s`` the tier is under pressure; it recovers only below
  ``low_water_s`` (hysteresis: no flapping between the two marks);
* under pressure no cascade is sent, so no sample arrives -- the average therefore decays
  by half every ``decay_half_life_s`` of silence, until a probe store gets through;
* for ``cooldown_s`` after recovering, every second cascade is dropped (a burst of stores
  would bring the pressure straight back);
* ``failure_threshold`` failed cascades in a row (a full disk) count as pressure too;
* after ten fast completions in a row the tier is *healthy*: the policy is not asked.

The default policy, :class:`ThrottledDropPolicy`, drops a share of cascades that grows with
the overshoot: none at ``high_water_s``, all at ``(1 + ramp_factor) * high_water_s``.

Time comes from ``clock`` (``time.monotonic`` by default, looked up at each call, as vLLM's
code reads it). kvlab's tests and lessons pass their own clock, so every verdict here is a
function of the samples fed in, never of how fast the machine ran.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from kvlab.utils.checks import check_int, check_number

__all__ = [
    "BackpressurePolicy",
    "DropAccountingPolicy",
    "DropStorePolicy",
    "ThrottledDropPolicy",
    "BackpressureDetector",
    "EMABackpressureDetector",
]

Clock = Callable[[], float]


def _monotonic() -> float:
    return time.monotonic()  # looked up per call: a test may replace time.monotonic


class BackpressurePolicy(ABC):
    """What to do with a cascade while its tier's detector says "pressure"."""

    @abstractmethod
    def should_store(self, detector: BackpressureDetector) -> bool: ...

    @abstractmethod
    def on_store_skipped(self, num_blocks: int) -> None: ...

    @abstractmethod
    def pop_stores_dropped(self) -> tuple[int, int]:
        """``(stores dropped, blocks dropped)`` since the last call; both counters restart."""

    @abstractmethod
    def reset(self) -> None: ...


class DropAccountingPolicy(BackpressurePolicy):
    """Counts what was dropped, the same way for every policy built on it."""

    def __init__(self) -> None:
        self._stores_dropped = 0
        self._blocks_dropped = 0

    def on_store_skipped(self, num_blocks: int) -> None:
        self._stores_dropped += 1
        self._blocks_dropped += num_blocks

    def pop_stores_dropped(self) -> tuple[int, int]:
        out = (self._stores_dropped, self._blocks_dropped)
        self._stores_dropped = self._blocks_dropped = 0
        return out

    def reset(self) -> None:
        self._stores_dropped = self._blocks_dropped = 0


class DropStorePolicy(DropAccountingPolicy):
    """All or nothing: every cascade is dropped while the tier is under pressure."""

    def should_store(self, detector: BackpressureDetector) -> bool:
        return not detector.is_under_pressure()


class ThrottledDropPolicy(DropAccountingPolicy):
    """Drop a share of cascades proportional to how far the average overshoots.

    ``drop_rate = min(1, (ema - high) / high / ramp_factor)``. The rates of successive
    decisions are summed; each time the sum reaches 1, that cascade is dropped and 1 is
    taken off (the remainder carries over). So at a rate of 0.25 exactly every fourth
    cascade is dropped -- deterministic, no random numbers.
    """

    def __init__(self, ramp_factor: float = 2.0) -> None:
        super().__init__()
        self._ramp_factor = check_number("ramp_factor", ramp_factor, 0, strict=True)
        self._drop_accumulator = 0.0

    def should_store(self, detector: BackpressureDetector) -> bool:
        if not isinstance(detector, EMABackpressureDetector):
            # It reads the average and the high-water mark, which only that detector has.
            raise TypeError(f"ThrottledDropPolicy needs an EMABackpressureDetector, got {type(detector).__name__}")
        if not detector.is_under_pressure():
            return True
        high = detector.high_water_s
        if high <= 0:
            return False
        rate = min(1.0, max(0.0, detector.store_latency_ema - high) / high / self._ramp_factor)
        if rate <= 0:
            return True
        if rate >= 1.0:
            return False
        self._drop_accumulator += rate
        if self._drop_accumulator >= 1.0:
            self._drop_accumulator -= 1.0
            return False
        return True

    def reset(self) -> None:
        super().reset()
        self._drop_accumulator = 0.0


class BackpressureDetector(ABC):
    """Watches finished cascades of one tier and says whether it is under pressure."""

    def __init__(self, policy: BackpressurePolicy | None = None, *, clock: Clock | None = None) -> None:
        if policy is not None and not isinstance(policy, BackpressurePolicy):
            raise TypeError(f"policy must be None or a BackpressurePolicy, got {type(policy).__name__}")
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be None or a function returning seconds, got {type(clock).__name__}")
        self._policy = policy if policy is not None else ThrottledDropPolicy()
        self._clock: Clock = clock if clock is not None else _monotonic

    @property
    def policy(self) -> BackpressurePolicy:
        return self._policy

    def now(self) -> float:
        """This detector's clock: when a cascade is submitted, for :meth:`update`."""
        return self._clock()

    @abstractmethod
    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None: ...

    def on_store_failed(self) -> None:
        """A cascade finished unsuccessfully. Ignored unless a detector counts failures."""
        return

    @abstractmethod
    def is_under_pressure(self) -> bool: ...

    @abstractmethod
    def reset(self) -> None: ...

    def update(self, submit_time: float, num_bytes: int) -> None:
        """A cascade submitted at ``submit_time`` (this detector's clock) wrote ``num_bytes``.
        A job that wrote nothing says nothing about the tier's speed."""
        if num_bytes <= 0:
            return
        self.on_store_completed(self._clock() - submit_time, num_bytes)

    def should_store(self, num_blocks: int) -> bool:
        """Whether to send a cascade of ``num_blocks`` now; a refusal is counted as dropped."""
        if self._policy.should_store(self):
            return True
        self._policy.on_store_skipped(num_blocks)
        return False

    @classmethod
    def default_config(cls, tier_type: str, *, locality: str | None = None) -> dict[str, Any] | None:
        """Constructor arguments this detector wants for ``tier_type`` unless configured."""
        return None

    @property
    def stats(self) -> dict[str, float]:
        return {}


class EMABackpressureDetector(BackpressureDetector):
    """Exponential moving average of cascade latency, in seconds per MiB (so a job's size
    does not matter); the water marks are in the same unit. See the module docstring."""

    _MIB = 1 << 20
    DEFAULT_ALPHA = 0.15
    DEFAULT_WARMUP_COMPLETIONS = 10
    DEFAULT_DECAY_HALF_LIFE_S = 2.0
    DEFAULT_COOLDOWN_S = 1.0
    DEFAULT_FAILURE_THRESHOLD = 3
    _HEALTHY_THRESHOLD = 10  # fast completions in a row before the policy is skipped
    # A failure streak lifts the average to 4x the high mark: with the default ramp (2.0)
    # the throttled policy then drops everything until idle decay lets a probe through.
    _FAILURE_EMA_FACTOR = 4.0

    # Local NVMe/SSD (about 5 GB/s) and network file systems or object stores (about
    # 1.5 GB/s): vLLM's presets, from its fio runs.
    LOCAL_HIGH_WATER_S = 0.010
    LOCAL_LOW_WATER_S = 0.002
    NETWORK_HIGH_WATER_S = 0.050
    NETWORK_LOW_WATER_S = 0.010
    _NETWORK_TIER_TYPES = frozenset({"obj"})
    _STORAGE_TIER_TYPES = frozenset({"fs", "obj"})

    @classmethod
    def default_config(cls, tier_type: str, *, locality: str | None = None) -> dict[str, Any]:
        """Network marks for an object store or a tier with ``locality="REMOTE"``, local
        marks otherwise; storage tiers also treat 3 failures in a row as pressure (a peer
        tier's failures are about one request, not the tier's health)."""
        remote = locality is not None and locality.upper() == "REMOTE"
        if remote or tier_type in cls._NETWORK_TIER_TYPES:
            config: dict[str, Any] = {"high_water_s": cls.NETWORK_HIGH_WATER_S, "low_water_s": cls.NETWORK_LOW_WATER_S}
        else:
            config = {"high_water_s": cls.LOCAL_HIGH_WATER_S, "low_water_s": cls.LOCAL_LOW_WATER_S}
        if tier_type in cls._STORAGE_TIER_TYPES:
            config["failure_threshold"] = cls.DEFAULT_FAILURE_THRESHOLD
        return config

    def __init__(
        self,
        high_water_s: float,
        low_water_s: float,
        alpha: float = DEFAULT_ALPHA,
        warmup_completions: int = DEFAULT_WARMUP_COMPLETIONS,
        decay_half_life_s: float = DEFAULT_DECAY_HALF_LIFE_S,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        failure_threshold: int | None = None,
        policy: BackpressurePolicy | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(policy=policy, clock=clock)
        high = check_number("high_water_s", high_water_s)
        low = check_number("low_water_s", low_water_s)
        a = check_number("alpha", alpha)
        if not 0 < a <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if low > high:
            raise ValueError(f"low_water_s ({low_water_s}) must be <= high_water_s ({high_water_s})")
        if failure_threshold is not None:
            failure_threshold = check_int("failure_threshold", failure_threshold)
            if failure_threshold < 1:
                raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self._alpha = a
        self._high = high
        self._low = low
        self._warmup_completions = check_int("warmup_completions", warmup_completions, 0)
        self._decay_half_life_s = check_number("decay_half_life_s", decay_half_life_s)
        self._cooldown_s = check_number("cooldown_s", cooldown_s)
        self._failure_threshold = failure_threshold
        self._ema = 0.0
        self._under_pressure = False
        self._completions = 0
        self._warmup_samples: list[float] = []
        self._last_update = 0.0  # clock time of the last change to the average (idle decay)
        self._healthy_streak = 0
        self._pressure_cleared_at = 0.0  # 0: no cooldown running
        self._cooldown_count = 0
        self._consecutive_failures = 0
        # Failures can trip pressure during warm-up; then the average must decay anyway.
        self._failure_tripped = False

    @property
    def high_water_s(self) -> float:
        return self._high

    @property
    def low_water_s(self) -> float:
        return self._low

    def _apply_idle_decay(self) -> None:
        """Halve the average per ``decay_half_life_s`` since it last changed: with no
        cascade sent there is no sample, and without decay pressure would never clear."""
        now = self._clock()
        dt = now - self._last_update
        if dt <= 0 or self._decay_half_life_s <= 0:
            return
        self._ema *= 0.5 ** (dt / self._decay_half_life_s)
        self._last_update = now

    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None:
        now = self._clock()
        sample = elapsed_s / (num_bytes / self._MIB)
        self._consecutive_failures = 0
        self._completions += 1
        if self._completions <= self._warmup_completions:
            self._warmup_samples.append(sample)
            if self._completions == self._warmup_completions:
                self._ema = sum(self._warmup_samples) / len(self._warmup_samples)
                self._last_update = now
            return
        self._ema = self._alpha * sample + (1 - self._alpha) * self._ema
        self._last_update = now
        if self._ema > self._high:
            self._under_pressure = True
            self._pressure_cleared_at = 0.0
            self._healthy_streak = 0
        elif self._ema < self._low:
            if self._under_pressure:
                self._start_cooldown(now)
            self._under_pressure = False
            self._failure_tripped = False
            self._healthy_streak += 1
        else:  # between the marks: the state holds, the healthy streak does not
            self._healthy_streak = 0

    def _start_cooldown(self, now: float) -> None:
        self._pressure_cleared_at = now
        self._cooldown_count = 0

    def on_store_failed(self) -> None:
        """``failure_threshold`` failures in a row: pressure, with the average lifted so
        every cascade is dropped until idle decay lets a probe through. A failed probe
        trips it again at once (the streak is still at the threshold); a success ends it."""
        if self._failure_threshold is None:
            return
        self._consecutive_failures += 1
        self._healthy_streak = 0
        if self._consecutive_failures < self._failure_threshold:
            return
        self._ema = max(self._ema, self._high * self._FAILURE_EMA_FACTOR)
        self._last_update = self._clock()
        self._under_pressure = True
        self._failure_tripped = True
        self._pressure_cleared_at = 0.0

    def is_under_pressure(self) -> bool:
        if self._under_pressure and (self._completions >= self._warmup_completions or self._failure_tripped):
            self._apply_idle_decay()
            if self._ema < self._low:
                self._under_pressure = False
                self._failure_tripped = False
                self._start_cooldown(self._clock())
        return self._under_pressure

    def is_healthy(self) -> bool:
        """Ten fast completions in a row and no pressure: cascades skip the policy."""
        return not self._under_pressure and self._healthy_streak >= self._HEALTHY_THRESHOLD

    def should_store(self, num_blocks: int) -> bool:
        under_pressure = self.is_under_pressure()
        if self.is_healthy():
            return True
        if not under_pressure and self._pressure_cleared_at > 0 and self._clock() - self._pressure_cleared_at < self._cooldown_s:
            # Just recovered: every second cascade waits.
            self._cooldown_count += 1
            if self._cooldown_count % 2 == 0:
                self._policy.on_store_skipped(num_blocks)
                return False
        return super().should_store(num_blocks)

    def reset(self) -> None:
        self._ema = 0.0
        self._under_pressure = False
        self._completions = 0
        self._warmup_samples.clear()
        self._last_update = 0.0
        self._healthy_streak = 0
        self._pressure_cleared_at = 0.0
        self._cooldown_count = 0
        self._consecutive_failures = 0
        self._failure_tripped = False
        self._policy.reset()

    @property
    def store_latency_ema(self) -> float:
        return self._ema

    @store_latency_ema.setter
    def store_latency_ema(self, value: float) -> None:
        self._ema = value

    @property
    def stats(self) -> dict[str, float]:
        return {"store_latency_ema": self._ema, "consecutive_store_failures": self._consecutive_failures}
