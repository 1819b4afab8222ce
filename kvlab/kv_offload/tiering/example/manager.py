"""The smallest secondary tier (vLLM 0.33: ``ExampleSecondaryTierManager`` in
``vllm/v1/kv_offload/tiering/example/manager.py``): it remembers which keys it holds and
finishes every job the moment it is submitted. It moves no bytes -- it is a reference for
writing a tier, and a way to drive :class:`~kvlab.kv_offload.tiering.manager.TieringOffloadingManager`
without a disk or a network.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from kvlab.kv_offload.base import ConfigInfo, ConfigInfoMapping, LookupResult, Medium, OffloadKey, ReqContext, RequestOffloadingContext
from kvlab.kv_offload.tiering.backpressure import BackpressureDetector
from kvlab.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob


@dataclass(frozen=True)
class ExampleTierInfo(ConfigInfo):
    """The tier's one config fact (a label of ``vllm:kv_offload_config_info``)."""

    example_info: int


class ExampleSecondaryTierManager(SecondaryTierManager):
    """Keys in a dict, jobs done at submission (reported at the next poll)."""

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        custom_param: int = 0,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._config_info = ExampleTierInfo(example_info=custom_param)
        self.chunks: dict[OffloadKey, bool] = {}
        self.completed_jobs: list[JobResult] = []

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ExampleTierInfo.config_info_keys()

    def config_info(self) -> ConfigInfoMapping:
        return self._config_info.as_config_info()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in self.chunks else LookupResult.MISS

    def _check_job(self, job: TransferJob) -> None:
        if len(job.keys) != len(job.chunk_ids):
            raise ValueError(f"job {job.job_id}: {len(job.keys)} keys but {len(job.chunk_ids)} chunk ids")

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._check_job(job_metadata)
        for key in job_metadata.keys:
            self.chunks[key] = True
        self.completed_jobs.append(JobResult(job_metadata.job_id, True, transfer_time=0.0))

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Fails the whole job if one key is missing (evicted since the lookup)."""
        self._check_job(job_metadata)
        ok = all(key in self.chunks for key in job_metadata.keys)
        self.completed_jobs.append(JobResult(job_metadata.job_id, True, transfer_time=0.0) if ok else JobResult(job_metadata.job_id, False))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done, self.completed_jobs = self.completed_jobs, []
        return done

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        return  # every job ended inside its submit call

    def get_num_chunks(self) -> int:
        return len(self.chunks)
