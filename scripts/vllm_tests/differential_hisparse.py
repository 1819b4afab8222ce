"""A differential run of HiSparse's runtime: vLLM 0.33.0's ``KVCacheManager`` with its
``HiSparseCoordinator`` and kvlab's, driven by the same random workloads, compared after
every call.

Each workload is what HiSparse's connector and the scheduler do, step by step: requests
arrive (sharing prefixes, so that host prefix hits and the adoption of GPU copies happen),
are looked up and admitted in chunks, decode, and finish or are preempted; each step the
coordinator's per-step work runs for the scheduled requests (``advance_scheduled``), its
transfers are taken (``build_offload_command``), some are reported done by one or two
workers (``update_spills``), sometimes only later or only in part; a request is sometimes
told to take its hot buffer (``require_hot``), and other allocations sometimes take
blocks from the GPU pool for a while (reusing unpinned pages). Every answer must be the same
on both sides, and after every step so must

* each request's block table per group, and its resident row as the worker reads it,
* the transfers (ids, host block, resident blocks, direction), residency updates, row
  mirrors and whether the whole context is on the GPU,
* both pools' free queues (block ids, in order) and every block's reference count,
* the step's KV events, byte for byte (both media).

    KVLAB_VLLM_PATH=/tmp/vtw/src:/tmp/vtw/deps python scripts/vllm_tests/differential_hisparse.py [--workloads N] [--seed S]

Exits 1 at the first divergence, printing the workload, the step and what differed.
"""

from __future__ import annotations

import argparse
import random
import sys
from types import SimpleNamespace
from typing import Any

import differential as d  # noqa: E402  (sets vLLM's path up first)
import torch  # noqa: E402

import vllm.v1.hisparse.coordinator as v_hisparse  # noqa: E402

BS = 16
F32 = dict(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)


def build(side: SimpleNamespace, num_blocks: int, host_blocks: int, caching: bool, resident_groups: int) -> tuple[Any, Any]:
    iface = side.iface
    src = iface.FullAttentionSpec(**F32)
    groups = [
        iface.KVCacheGroupSpec(["source"], src, role=iface.KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True),
        iface.KVCacheGroupSpec(["indexer"], src, role=iface.KVCacheGroupRole.HISPARSE_INDEXER),
    ]
    for g in range(resident_groups):
        groups.append(iface.KVCacheGroupSpec([f"resident{g}"], iface.HiSparseResidentSpec(block_size=BS, page_size=4 * BS)))
        groups.append(iface.KVCacheGroupSpec([f"hot{g}"], iface.HiSparseHotSpec(block_size=BS, page_size=4 * BS, blocks_per_request=2)))
    config = iface.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups, hisparse_host_num_blocks=host_blocks)
    own = {"hash_algo": "sha256_cbor"} if side is d.KVLAB else {"scheduler_block_size": BS}
    m = side.manager.KVCacheManager(
        config, **own, max_model_len=256, hash_block_size=BS, enable_caching=caching, enable_kv_cache_events=True
    )
    coord = m.hisparse if side is d.KVLAB else v_hisparse.get_hisparse_coordinator(m)
    return m, coord


def pool_state(m: Any, coord: Any) -> tuple:
    pools = (m.block_pool, coord.host_manager.block_pool)
    return tuple(([b.block_id for b in p.free_block_queue.get_all_free_blocks()], [b.ref_cnt for b in p.blocks]) for p in pools)


def rows(coord: Any, rid: str) -> list[list[int]]:
    return [[b.block_id for b in r.get_residency_row(rid)] for r in coord.resident_managers]


def transfers(coord: Any) -> list[tuple]:
    cmd = coord.build_offload_command()
    return [(t.transfer_id, t.host_block_id, tuple(t.resident_block_ids), t.after_forward, t.restore) for t in cmd.page_transfers]


def updates(coord: Any, rids: list[str]) -> dict[str, tuple]:
    return {rid: (u.pages, [list(x) for x in u.block_ids]) for rid, u in coord.take_residency_updates(rids).items()}


def mirrors(coord: Any, scheduled: list[tuple[str, int, int]]) -> list[tuple]:
    return [(tuple(x.source_starts), x.destination_start, x.num_rows) for x in coord.build_row_mirrors(scheduled)]


def tally(coord: Any, counts: dict[str, int]) -> None:
    """Count, on kvlab's side, the pages unpinned, lost and adopted (the same on vLLM's, or the
    books would differ)."""
    unpin, lose, adopt = coord._unpin_page, coord._lose_page, coord.resident_managers[0].adopt_resident_page

    def unpinned(*a: Any) -> bool:
        done = unpin(*a)
        counts["unpinned"] += done
        return done

    def lost(*a: Any) -> None:
        counts["lost"] += 1
        lose(*a)

    def adopted(*a: Any) -> bool:
        done = adopt(*a)
        counts["adopted"] += done
        return done

    coord._unpin_page, coord._lose_page, coord.resident_managers[0].adopt_resident_page = unpinned, lost, adopted


def run_one(seed: int, n_requests: int = 10) -> dict[str, int]:
    rng = random.Random(seed)
    caching = rng.random() < 0.8
    resident_groups = rng.choice([1, 1, 2])
    num_blocks, host_blocks = rng.randrange(16, 48), rng.randrange(12, 40)
    vm, vc = build(d.VLLM, num_blocks, host_blocks, caching, resident_groups)
    km, kc = build(d.KVLAB, num_blocks, host_blocks, caching, resident_groups)
    run = d.Run("hisparse", False, seed)
    counts = dict.fromkeys(
        ("steps", "transfers", "hit tokens", "hot buffer requests", "unpinned", "lost", "adopted", "finished", "preempted", "resets"), 0
    )
    tally(kc, counts)
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(16, 80))] for _ in range(2)]
    specs = []
    for i in range(n_requests):
        prompt = list(rng.choice(prefixes))[: rng.randrange(16, 81)] + [rng.randrange(4) for _ in range(rng.randrange(0, 20))]
        specs.append(
            d.Spec(
                f"r{i}",
                prompt,
                [rng.randrange(4) for _ in range(rng.randrange(1, 24))],
                None,
                None,
                rng.randrange(0, 3 * n_requests),
                [],
                False,
            )
        )
    waiting: list[d.Pair] = []
    running: list[d.Pair] = []
    in_flight: list[int] = []  # transfer ids not yet reported done
    halfway: set[int] = set()  # reported by the first of their two workers
    held: list[tuple[Any, Any]] = []  # blocks other allocations took, per side
    budget = rng.choice([16, 32, 64])
    for step in range(400):
        for s in specs:
            if s.arrival_step == step:
                waiting.append(d.Pair(s, d.make_request(d.VLLM, s, BS), d.make_request(d.KVLAB, s, BS)))
        scheduled: list[tuple[str, int, int]] = []
        left = budget
        for p in list(running):  # running first: a decode token or the next prefill chunk
            n = min(left, p.v.num_tokens - p.v.num_computed_tokens)
            if n <= 0:
                continue
            a, b = vm.allocate_slots(p.v, n), km.allocate_slots(p.k, n)
            d.same(run, step, f"{p.spec.rid}: allocate {n}", a is None, b is None)
            if a is None:  # preempted: freed, back to waiting, recomputed
                vm.free(p.v), km.free(p.k)
                running.remove(p)
                p.v.num_computed_tokens = p.k.num_computed_tokens = 0
                waiting.insert(0, p)
                counts["preempted"] += 1
                continue
            scheduled.append((p.spec.rid, p.v.num_computed_tokens, n))
            left -= n
        while waiting and left > 0:
            p = waiting[0]
            (vb, vn), (kb, kn) = vm.get_computed_blocks(p.v)[:2], km.get_computed_blocks(p.k)[:2]
            d.same(run, step, f"{p.spec.rid}: hit", (vn, vb.get_block_ids()), (kn, kb.get_block_ids()))
            n = min(left, p.v.num_tokens - vn)
            a, b = vm.allocate_slots(p.v, n, vn, vb), km.allocate_slots(p.k, n, kn, kb)
            d.same(run, step, f"{p.spec.rid}: admit {n} after a hit of {vn}", a is None, b is None)
            if a is None:
                break
            counts["hit tokens"] += vn
            waiting.pop(0)
            running.append(p)
            p.v.num_computed_tokens = p.k.num_computed_tokens = vn
            scheduled.append((p.spec.rid, vn, n))
            left -= n
        # the connector's per-step work, on both sides
        ends = [(rid, start + n) for rid, start, n in scheduled]
        vc.advance_scheduled(ends), kc.advance_scheduled(ends)
        vt, kt = transfers(vc), transfers(kc)
        d.same(run, step, "transfers", vt, kt)
        in_flight += [t[0] for t in vt]
        counts["transfers"] += len(vt)
        d.same(run, step, "row mirrors", mirrors(vc, scheduled), mirrors(kc, scheduled))
        d.same(run, step, "all context resident", vc.all_context_pages_resident(scheduled), kc.all_context_pages_resident(scheduled))
        rids = [rid for rid, _, _ in scheduled]
        d.same(run, step, "residency updates", updates(vc, rids), updates(kc, rids))
        # the step ran: tokens computed, one sampled per finished prefill
        for rid, start, n in scheduled:
            p = next(x for x in running if x.spec.rid == rid)
            p.v.num_computed_tokens = p.k.num_computed_tokens = start + n
            if p.v.num_computed_tokens == p.v.num_tokens:
                if p.produced == len(p.spec.outputs) or rng.random() < 0.05:
                    if rng.random() < 0.5:
                        p.v.status = d.VLLM.request.RequestStatus.FINISHED_STOPPED
                        p.k.status = d.KVLAB.request.RequestStatus.FINISHED_STOPPED
                    vm.free(p.v), km.free(p.k)
                    running.remove(p)
                    counts["finished"] += 1
                else:
                    tok = p.spec.outputs[p.produced]
                    p.produced += 1
                    p.v.append_output_token_ids(tok), p.k.append_output_token_ids(tok)
        # workers report some transfers: one worker, or two -- together, or the second later
        if in_flight and rng.random() < 0.7:
            rng.shuffle(in_flight)
            k = rng.randrange(1, len(in_flight) + 1)
            batch, in_flight = in_flight[:k], in_flight[k:]
            reports: dict[int, tuple[int, int]] = {}  # transfer id -> (workers running it, completions now)
            for t in batch:
                if t in halfway:
                    reports[t] = (2, 1)
                    halfway.discard(t)
                elif rng.random() < 0.3:
                    reports[t] = (2, 1)
                    halfway.add(t)
                    in_flight.append(t)
                else:
                    w = rng.choice([1, 2])
                    reports[t] = (w, w)
            # One report per request: vLLM publishes the host pages of the requests a report
            # completes in the order of a set of their ids (it depends on the string hash seed);
            # kvlab in the order they completed, so that a run is the same every time.
            by_request: dict[str, list[int]] = {}
            for t in reports:
                by_request.setdefault(kc.pending_spills[t].page[0], []).append(t)
            for rid in sorted(by_request):
                enq = {t: reports[t][0] for t in by_request[rid]}
                comp = {t: reports[t][1] for t in by_request[rid]}
                for side in (vc, kc):
                    side.update_spills(enq, comp)
        if running and rng.random() < 0.15:
            p = rng.choice(running)
            for side in (vc, kc):
                for h in side.hot_managers:
                    h.require_hot(p.spec.rid)
            counts["hot buffer requests"] += 1
        if rng.random() < 0.2:  # another allocation takes blocks for a while (reusing unpinned pages)
            n = min(vm.block_pool.get_num_free_blocks(), rng.randrange(1, 6))
            d.same(run, step, "free blocks", vm.block_pool.get_num_free_blocks(), km.block_pool.get_num_free_blocks())
            if n:
                held.append((vm.block_pool.get_new_blocks(n), km.block_pool.get_new_blocks(n)))
        if held and rng.random() < 0.3:
            vb, kb = held.pop(0)
            vm.block_pool.free_blocks(vb), km.block_pool.free_blocks(kb)
        if rng.random() < 0.05:  # a prefix-cache reset: refused while any block is held, in either pool
            done = vm.reset_prefix_cache()
            d.same(run, step, "reset_prefix_cache", done, km.reset_prefix_cache())
            counts["resets"] += done
        for p in running:
            d.same(run, step, f"{p.spec.rid}: block table", vm.get_block_ids(p.spec.rid), km.get_block_ids(p.spec.rid))
            d.same(run, step, f"{p.spec.rid}: resident rows", rows(vc, p.spec.rid), rows(kc, p.spec.rid))
        d.same(run, step, "pools (free queue, ref counts): GPU, host", pool_state(vm, vc), pool_state(km, kc))
        d.same(run, step, "KV events", d.events(vm), d.events(km))
        counts["steps"] += 1
        if not running and not waiting and step > 3 * n_requests:
            break
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    d.v_utils.init_none_hash(d.v_hashing.sha256_cbor)
    d.k_utils.init_none_hash(d.k_hashing.sha256_cbor)
    total: dict[str, int] = {}
    for i in range(args.workloads):
        try:
            counts = run_one(args.seed + i)
        except d.Divergence as e:
            print(f"DIVERGED at workload {i} (seed {args.seed + i}):\n{e}")
            return 1
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
    print(f"{args.workloads} workloads agree: " + ", ".join(f"{k} {v:,}" for k, v in total.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
