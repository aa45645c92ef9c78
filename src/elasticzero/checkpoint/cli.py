"""``elasticzero-checkpoint``: look at, check and convert checkpoint directories without a distributed run.

``inspect DIR`` lists the committed steps (newest last) with world size, size and the scalars the job's state
recorded (ZeRO stage, precision, sampler position, LR-scheduler epoch, loss scale ...); ``verify DIR`` checks every
file of every committed step (sizes and checksums against the manifest, DCP metadata readable and covering every
tensor); ``consolidate DIR OUT`` writes the full fp32 model ``state_dict`` of a ZeRO checkpoint as one file loadable
with ``torch.load(OUT, weights_only=True)`` (DeepSpeed's ``zero_to_fp32``); ``import-deepspeed DS_DIR OUT`` turns a
DeepSpeed ZeRO checkpoint (stage 1, 2 or 3) into an elasticzero checkpoint that loads at any world size and stage.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from elasticzero.checkpoint import commit
from elasticzero.checkpoint.planner import read_metadata_file
from elasticzero.errors import UsageError, cli_main
from elasticzero.fileio import write_atomic

PROG = "elasticzero-checkpoint"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="list committed steps, the latest, world size, stage, sizes, positions")
    ins.add_argument("directory", help="checkpoint directory (the Checkpointer's)")
    ins.add_argument("--json", action="store_true", help="print the manifests as JSON instead of a table")
    ver = sub.add_parser("verify", help="check every file of every committed step (exit 1 if any is bad)")
    ver.add_argument("directory")
    ver.add_argument("--step", type=int, default=None, help="check only this step")
    con = sub.add_parser("consolidate", help="write the full fp32 model state_dict of a ZeRO checkpoint")
    con.add_argument("directory")
    con.add_argument("out", help="output file (torch.save format; load with torch.load(OUT, weights_only=True))")
    con.add_argument("--step", type=int, default=None, help="step to convert (default: the latest)")
    con.add_argument("--key", default=None, help="state key of the ZeRO state when the checkpoint holds several")
    imp = sub.add_parser("import-deepspeed", help="import a DeepSpeed ZeRO 1/2/3 checkpoint as a new checkpoint")
    imp.add_argument("ds_directory", help="DeepSpeed save_checkpoint directory (holds 'latest' and tag directories)")
    imp.add_argument("out", help="new elasticzero checkpoint directory (must hold no checkpoint yet)")
    imp.add_argument("--tag", default=None, help="DeepSpeed tag to import (default: the one 'latest' names)")
    imp.add_argument("--key", default="zero", help="state key of the ZeRO state in the new checkpoint (default zero)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(PROG, _run, argv)


def _run(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "import-deepspeed":
        return _import_deepspeed(Path(args.ds_directory), Path(args.out), args.tag, args.key)
    root = Path(args.directory)
    if not root.is_dir():
        raise UsageError(f"{root}: no such checkpoint directory")
    if args.command == "inspect":
        return _inspect(root, args.json)
    if args.command == "verify":
        return _verify(root, args.step)
    return _consolidate(root, Path(args.out), args.step, args.key)


# -- inspect ---------------------------------------------------------------------------------------------------------
def _inspect(root: Path, as_json: bool) -> int:
    listing = commit.list_dir(root)
    manifests = {step: commit.read_manifest(root / name) for step, name in sorted(listing.committed.items())}
    if as_json:
        print(json.dumps({"latest": commit.latest_step(listing), "steps": manifests}, indent=1, sort_keys=True))
        return 0
    if not manifests:
        print(f"{root}: no committed checkpoint")
    for step, m in manifests.items():
        print(f"step {step}: world size {m['world_size']}, {len(m['files'])} files, {_size(m)}, saved {m['created']}")
        for key, scalars in sorted(m.get("info", {}).items()):
            shown = ", ".join(f"{k}={v}" for k, v in sorted(scalars.items()))
            print(f"  {key}: {shown}" if shown else f"  {key}")
    latest = commit.latest_step(listing)
    print(f"latest: {latest}" + (f" ({listing.committed[latest]})" if latest is not None else ""))
    for name in listing.aside:
        print(f"ignored: {name} (an unfinished save or deletion)")
    return 0


def _size(manifest: dict[str, Any]) -> str:
    total = sum(f["size"] for f in manifest["files"].values())
    return f"{total / 2**20:.1f} MiB on disk"


# -- verify ----------------------------------------------------------------------------------------------------------
def _verify(root: Path, only: int | None) -> int:
    listing = commit.list_dir(root)
    steps = sorted(listing.committed) if only is None else [only]
    if not steps:
        raise UsageError(f"{root}: no committed checkpoint to verify")
    bad = 0
    for step in steps:
        problems = step_problems(root / commit.step_dir(step))
        bad += bool(problems)
        print(f"step {step}: " + ("OK" if not problems else "BAD"))
        for p in problems:
            print(f"  {p}")
    return 1 if bad else 0


def step_problems(directory: Path) -> list[str]:
    """Everything wrong with one committed step directory (empty: every file is as the manifest says)."""
    if not directory.is_dir():
        return [f"{directory}: missing"]
    try:
        manifest = commit.read_manifest(directory)
    except UsageError as exc:
        return [str(exc)]
    files = manifest["files"]
    problems = commit.file_errors(directory, files, sorted(files), check_digest=True)
    if problems or ".metadata" not in files:
        return problems or [f"{directory}: no .metadata in the manifest"]
    try:
        md = read_metadata_file(str(directory / ".metadata"))
    except UsageError as exc:
        return [str(exc)]
    return _coverage_problems(directory, md, files)


def _coverage_problems(directory: Path, md: Any, files: dict[str, Any]) -> list[str]:
    problems = []
    for index, info in (md.storage_data or {}).items():
        f = files.get(info.relative_path)
        if f is None or info.offset + info.length > f["size"]:
            problems.append(f"{directory / str(info.relative_path)}: entry {index.fqn!r} lies outside the file")
    for fqn, tmd in md.state_dict_metadata.items():
        chunks = getattr(tmd, "chunks", None)
        if chunks is not None and sum(math.prod(c.sizes) for c in chunks) != math.prod(tmd.size):
            problems.append(f"{directory}: {fqn!r} is not covered by its saved chunks (a rank's shard is missing)")
    return problems


# -- consolidate -----------------------------------------------------------------------------------------------------
def _consolidate(root: Path, out: Path, step: int | None, key: str | None) -> int:
    listing = commit.list_dir(root)
    step = commit.latest_step(listing) if step is None else step
    if step is None or step not in listing.committed:
        raise UsageError(f"{root}: no committed step {'' if step is None else step}".rstrip())
    directory = root / listing.committed[step]
    problems = step_problems(directory)
    if problems:
        raise UsageError(problems[0])
    sd = consolidated_state_dict(directory, key)
    write_atomic(out, lambda fh: torch.save(sd, fh))
    print(f"wrote {out}: {len(sd)} entries, {sum(t.numel() for t in sd.values())} elements, step {step}")
    return 0


def consolidated_state_dict(directory: Path, key: str | None = None) -> dict[str, torch.Tensor]:
    """The full model state dict of the ZeRO state saved under ``key`` in ``directory`` (fp32 trainable
    parameters, tied aliases, frozen parameters and buffers), read in this process."""
    import torch.distributed.checkpoint as dcp

    from elasticzero.checkpoint.planner import SafeFileSystemReader, ZeroLoadPlanner

    md = read_metadata_file(str(directory / ".metadata")).state_dict_metadata
    prefix = _zero_prefix(md, key, directory)
    flat: dict[str, Any] = {}
    for fqn, tmd in md.items():
        for part in ("params", "module"):
            if fqn.startswith(f"{prefix}.{part}.") and isinstance(tmd, TensorStorageMetadata):
                flat[fqn] = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
        if fqn.startswith(f"{prefix}.layout."):
            flat[fqn] = None
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(flat, storage_reader=SafeFileSystemReader(directory), planner=ZeroLoadPlanner(), no_dist=True)
    out: dict[str, torch.Tensor] = {}
    for name, shape in flat[f"{prefix}.layout.shapes"]:
        out[name] = flat[f"{prefix}.params.{name}"].view(shape)
    for alias, name in flat.get(f"{prefix}.layout.aliases") or []:
        out[alias] = out[name]
    out.update(_under(flat, f"{prefix}.module."))
    return out


def _under(flat: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}


def _zero_prefix(md: dict[str, Any], key: str | None, directory: Path) -> str:
    prefixes = sorted(k.removesuffix(".layout.format") for k in md if k.endswith(".layout.format"))
    if key is not None:
        if key not in prefixes:
            raise UsageError(f"{directory}: no ZeRO state under key {key!r} (found: {prefixes or 'none'})")
        return key
    if len(prefixes) != 1:
        raise UsageError(
            f"{directory}: {'no ZeRO state' if not prefixes else 'several ZeRO states: ' + ', '.join(prefixes)}"
            + ("; pass --key" if prefixes else " (was it saved through ZeroCheckpointState?)")
        )
    return prefixes[0]


# -- import-deepspeed ------------------------------------------------------------------------------------------------
def _import_deepspeed(ds_dir: Path, out: Path, tag: str | None, key: str) -> int:
    from elasticzero.checkpoint.deepspeed_import import import_checkpoint

    if not ds_dir.is_dir():
        raise UsageError(f"{ds_dir}: no such DeepSpeed checkpoint directory")
    ck = import_checkpoint(ds_dir, out, tag, key)
    print(
        f"imported {ck.directory} (DeepSpeed {ck.version}, ZeRO-{ck.stage}, {ck.world_size} ranks, {ck.precision}) "
        f"as step {ck.step} of {out}: {len(ck.shapes)} parameters, optimizer state "
        f"{sorted({k for st in ck.states.values() for k in st} | set(ck.scalars)) or 'none'}"
    )
    return 0
