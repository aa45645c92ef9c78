"""Worker for test_ring: ring collectives vs gloo's own on the same inputs; writes JSON results per rank."""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch
import torch.distributed as dist

from elasticzero.engine.zero import ring
from elasticzero.engine.zero.comm.communicator import Communicator


def main(out: str) -> None:
    dist.init_process_group("gloo")
    n, r = dist.get_world_size(), dist.get_rank()
    com = Communicator()
    results: dict[str, object] = {"used_ring": com.uses_ring}
    tags = itertools.count()  # this worker's own ring sequence (every rank runs the same)
    gen = torch.Generator().manual_seed(1234)
    for c in (1, 5, 1001):  # chunk sizes: one element, odd, larger
        inputs = [torch.randn(n * c, generator=gen, dtype=torch.float64) for _ in range(n)]
        mine = inputs[r].clone()
        shard = torch.empty(c, dtype=torch.float64)
        work = ring.reduce_scatter(shard, mine, dist.group.WORLD, ring.message_tag(next(tags)), lambda t: None)
        work.wait()
        work.wait()  # idempotent
        expect = sum(inputs)[r * c : (r + 1) * c]
        # fp64 sums of n <= 3 values |x| < 6 in any order: (n - 1) * 2^-53 * 18 < 1e-14 apart; atol 1e-12 on any CPU
        results[f"rs{c}"] = bool(torch.allclose(shard, expect, rtol=0, atol=1e-12))
        results[f"rs{c}_input_intact"] = bool(torch.equal(mine, inputs[r]))
        in_place = inputs[r].clone()  # the shard reduced into this rank's own chunk of the input
        ring.reduce_scatter(
            in_place[r * c : (r + 1) * c], in_place, dist.group.WORLD, ring.message_tag(next(tags)), lambda t: None
        ).wait()
        results[f"rs{c}_in_place"] = bool(torch.allclose(in_place[r * c : (r + 1) * c], expect, rtol=0, atol=1e-12))
        native = torch.empty(c, dtype=torch.float64)
        dist.reduce_scatter_tensor(native, inputs[r].clone())
        results[f"rs{c}_native"] = bool(torch.allclose(shard, native, rtol=0, atol=1e-12))
        full = torch.full((n * c,), float("nan"), dtype=torch.float64)
        full[r * c : (r + 1) * c] = inputs[r][:c]
        mine_chunk = full[r * c : (r + 1) * c]
        ring.all_gather(full, mine_chunk, dist.group.WORLD, ring.message_tag(next(tags)), lambda t: None).wait()
        results[f"ag{c}"] = bool(torch.equal(full, torch.cat([x[:c] for x in inputs])))
        separate = torch.empty(n * c, dtype=torch.float64)
        com.all_gather(separate, inputs[r][:c])  # the sync path of the communicator, through the ring
        results[f"ag{c}_comm"] = bool(torch.equal(separate, full))
    # two rings in flight at once, waited in reverse order (tags keep their messages apart)
    a_in, b_in = torch.full((n * 3,), float(r + 1)), torch.full((n * 4,), float(10 * (r + 1)))
    a_out, b_out = torch.empty(3), torch.empty(4)
    wa = com.reduce_scatter(a_out, a_in, async_op=True)
    wb = com.reduce_scatter(b_out, b_in, async_op=True)
    assert wa is not None and wb is not None
    wb.wait()
    wa.wait()
    com.settle()
    total = n * (n + 1) / 2
    results["overlapped"] = bool(torch.all(a_out == total) and torch.all(b_out == 10 * total))
    # the same on two fresh communicators of one group: equal tags (each counts from 0); gloo matches sends and
    # receives of one peer and tag in posting order, the same on every rank
    first, second = Communicator(), Communicator()
    a_out, b_out = torch.empty(3), torch.empty(4)
    wa = first.reduce_scatter(a_out, a_in, async_op=True)
    wb = second.reduce_scatter(b_out, b_in, async_op=True)
    assert wa is not None and wb is not None
    wb.wait()
    wa.wait()
    results["two_communicators"] = bool(torch.all(a_out == total) and torch.all(b_out == 10 * total))
    for c in (com, first, second):
        c.close()
    results["unsettled"] = com.unsettled + first.unsettled + second.unsettled
    with open(f"{out}.rank{r}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
