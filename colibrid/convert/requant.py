"""``colibri requant MODEL --by-heat PROFILE``: a new container whose routed experts carry
precisions chosen by heat (colibrid/convert/heat.py), written resumably and atomically.

Why a new container, never an edit in place: a plan is lossy and opt-in (DESIGN §4), so
MODEL stays exactly as it was: undoing a plan is using MODEL again, and changing it is
another requant from MODEL. The new container's manifest records the plan (its id, the
options, the profile's SHA-256, every expert's bits) and where its bits came from
(MODEL's folder and manifest digest, and ``--source`` when given).

Where the weights come from:

* an expert whose planned format is the one MODEL stores is copied byte for byte;
* with ``--source CKPT`` (the checkpoint MODEL was converted from, f32/bf16/FP8), every
  other expert is quantised from the source's full precision: a hot expert can really be
  raised to 8 bits and a cold one loses only the bits its own format loses;
* without it, an expert is requantised from MODEL's stored weight (dequantised), so a
  cold expert rounds twice, and an expert planned *above* its stored precision keeps
  what is stored (more bits of an int4 weight would be the same weight, larger): the
  command says how many it kept.

Everything that is not a routed expert of the main layers (attention, shared experts,
embeddings, the MTP layer) is copied byte for byte, in MODEL's order. Writing reuses the
converter's machinery (convert.py): the layout is planned before a byte is written,
shards are written under hidden names, fsynced and renamed into place, a progress file
makes an interrupted run resume to the same bytes, and ``manifest.json`` comes last.

``--max-kl X`` writes candidates at increasing cold shares, scores each with
``colibri eval`` against the reference (``--against``, default ``--source`` or MODEL)
and keeps the largest cold share whose mean KL stays at or under X.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from colibrid.convert.convert import MANIFEST_NAME, finish, prepare_dst, run_shards
from colibrid.convert.convert import SIDE_FILES as CONVERTER_SIDE_FILES
from colibrid.convert.heat import BITS, HeatOptions, HeatPlan, plan_by_heat
from colibrid.convert.plan import CONVERTER_VERSION, ConvertParams, Group, Shard
from colibrid.convert.writer import Entry, write_atomic
from colibrid.errors import ColibriError, ConvertError
from colibrid.file_hash import sha256_of
from colibrid.formats import quant
from colibrid.formats.weights import WeightFormat
from colibrid.store.checkpoint import Checkpoint
from colibrid.store.container_format import (
    GROUP_SIZE_KEY,
    INT4_GROUPED,
    INT4_ROW,
    INT8_ROW,
    STAMP_KEY,
    container_candidates,
)
from colibrid.store.experts import PROJECTIONS, ExpertLayout
from colibrid.store.precision_plan import plan_of, stored_label
from colibrid.store.usage import parse_counts

if TYPE_CHECKING:
    from colibrid.convert.source import Source

SIDE_FILES = ("config.json", *CONVERTER_SIDE_FILES)  # the model, and what the converter copies
# The file order of an expert's tensors, as the converter writes them (plan.build_groups).
FILE_ORDER = ("down_proj", "gate_proj", "up_proj")
DTYPES = {np.dtype(np.uint8): "U8", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
MAX_KL_SHARES = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875)


def weight_format(bits: int) -> WeightFormat:
    return {2: WeightFormat.Q2, 3: WeightFormat.Q3, 4: WeightFormat.Q4, 8: WeightFormat.Q8}[bits]


def label_bits(label: str) -> int:
    """The bits a weight of stored format ``label`` carries (for "raise or keep")."""
    for prefix, bits in (("int8", 8), ("int4", 4), ("fp4", 4), ("int3", 3), ("int2", 2)):
        if label.startswith(prefix):
            return bits
    return {"bf16": 16, "f16": 16, "f32": 32}.get(label, 32)


@dataclass(frozen=True)
class Target:
    """How one expert matrix is written: copied, or quantised to ``fmt``."""

    copy: bool
    fmt: WeightFormat | None = None
    group_size: int = 0


class Signatures:
    """Header entries of a quantised matrix, from quantising one zero row: exactly what
    ``quant.container_tensors`` will write, without knowing each format's layout here."""

    def __init__(self) -> None:
        self._seen: dict[tuple, list[tuple[str, str, tuple[int, ...]]]] = {}

    def entries(self, name: str, shape: tuple[int, int], target: Target) -> list[Entry]:
        assert target.fmt is not None
        key = (target.fmt, target.group_size, shape[1])
        if key not in self._seen:
            probe = quant.quantize(
                np.zeros((1, shape[1]), np.float32), target.fmt, target.group_size
            )
            tensors = quant.container_tensors("w", probe)
            self._seen[key] = [
                (k[1:], DTYPES[a.dtype], tuple(a.shape[1:])) for k, a in tensors.items()
            ]
        out = []
        for suffix, dtype, tail in self._seen[key]:
            full = (shape[0], *tail)
            itemsize = 1 if dtype == "U8" else 4 if dtype == "F32" else 2
            out.append(Entry(name + suffix, dtype, full, int(np.prod(full)) * itemsize))
        return out


def intended_format(target: Target) -> str:
    """The container format name the loader must read ``target`` as (for stamps)."""
    if target.fmt is WeightFormat.Q8:
        return INT8_ROW
    if target.fmt is WeightFormat.Q4:
        return INT4_GROUPED if target.group_size else INT4_ROW
    from colibrid.store.container_format import INT2_AFFINE, INT3_AFFINE

    return INT2_AFFINE if target.fmt is WeightFormat.Q2 else INT3_AFFINE


# ---- the plan ---------------------------------------------------------------------------


@dataclass
class Unit:
    """Tensors written back to back (a copied tensor with its scales, or one expert)."""

    entries: list[Entry]
    mtp: bool
    expert: tuple[int, int] | None = None  # (layer, expert) of a planned expert
    stamps: dict[str, str] | None = None


def _sorted_tensors(ckpt: Checkpoint) -> Iterator[tuple[str, str]]:
    """(file name, tensor name) of MODEL in file order."""
    for f in sorted(ckpt.files, key=lambda f: f.path.name):
        for info in sorted(f.tensors.values(), key=lambda t: t.file_begin):
            yield f.path.name, info.name


def plan_units(
    ckpt: Checkpoint,
    layout: ExpertLayout,
    targets: dict[tuple[int, int], dict[str, Target]],
    sig: Signatures,
    hint: int | None,
) -> list[Unit]:
    expert_names: dict[str, tuple[int, int, str]] = {}
    for layer, expert in targets:
        for proj in PROJECTIONS:
            name = layout.tensor_name(layer, expert, proj)
            expert_names[name] = (layer, expert, proj)
            expert_names[name + ".qs"] = (layer, expert, proj)
    units: list[Unit] = []
    placed: set[tuple[int, int]] = set()
    for file_name, name in _sorted_tensors(ckpt):
        mtp = file_name.startswith("out-mtp")
        where = expert_names.get(name)
        if where is None:
            if name.endswith(".qs") and ckpt.has(name[:-3]):
                continue  # written right after its weight
            info = ckpt.info(name)
            entries = [Entry(name, info.dtype, tuple(info.shape), info.nbytes)]
            if ckpt.has(name + ".qs"):
                qs = ckpt.info(name + ".qs")
                entries.append(Entry(name + ".qs", qs.dtype, tuple(qs.shape), qs.nbytes))
            stamp = ckpt.stamp(name)
            units.append(Unit(entries, mtp, None, {name: stamp} if stamp else None))
            continue
        key = where[:2]
        if key in placed:
            continue
        placed.add(key)
        data: list[Entry] = []
        scales: list[Entry] = []
        stamps: dict[str, str] = {}
        for proj in FILE_ORDER:
            tname = layout.tensor_name(key[0], key[1], proj)
            target = targets[key][proj]
            if target.copy:
                info = ckpt.info(tname)
                data.append(Entry(tname, info.dtype, tuple(info.shape), info.nbytes))
                if ckpt.has(tname + ".qs"):
                    qs = ckpt.info(tname + ".qs")
                    scales.append(Entry(tname + ".qs", qs.dtype, tuple(qs.shape), qs.nbytes))
                stamp = ckpt.stamp(tname)
                if stamp:
                    stamps[tname] = stamp
                continue
            d, s = sig.entries(tname, layout.shape(proj), target)
            data.append(d)
            scales.append(s)
            found = container_candidates(
                layout.shape(proj), d.nbytes, int(np.prod(s.shape)), s.dtype, hint
            )
            want = intended_format(target)
            if len(found) != 1 or found[0].name != want:
                stamps[tname] = want
        units.append(Unit(data + scales, mtp, key, stamps or None))
    missing = set(targets) - placed
    if missing:
        raise ConvertError(f"experts {sorted(missing)[:4]} planned but not found in the model")
    return units


def pack(
    units: Sequence[Unit], shard_bytes: int, hint: int | None
) -> list[tuple[Shard, list[Unit]]]:
    """Greedy packing as the converter's (plan.pack_shards): never splits a unit."""
    out: list[tuple[Shard, list[Unit]]] = []
    for mtp, prefix in ((False, "out"), (True, "out-mtp")):
        packs: list[list[Unit]] = []
        size = 0
        for u in (u for u in units if u.mtp == mtp):
            nbytes = sum(e.nbytes for e in u.entries)
            if not packs or (packs[-1] and size + nbytes > shard_bytes):
                packs.append([])
                size = 0
            packs[-1].append(u)
            size += nbytes
        for count, members in enumerate(packs):
            meta = {"format": "pt", "colibri.converter": CONVERTER_VERSION}
            if hint:
                meta[GROUP_SIZE_KEY] = str(hint)
            stamps = {k: v for u in members for k, v in (u.stamps or {}).items()}
            if stamps:
                meta[STAMP_KEY] = json.dumps(stamps, sort_keys=True, separators=(",", ":"))
            groups = []
            for u in members:
                g = Group([], mtp)
                g.entries = list(u.entries)
                groups.append(g)
            out.append((Shard(f"{prefix}-{count:05d}.safetensors", groups, meta), members))
    return out


# ---- the command ------------------------------------------------------------------------


@dataclass
class RequantResult:
    dst: Path
    plan_id: str
    heat: HeatPlan
    kept_stored: int  # experts planned above their stored precision, kept as stored
    written_shards: int


def load_profile(profile: Path, ckpt: Checkpoint, layout: ExpertLayout) -> np.ndarray:
    if not profile.is_file():
        raise ConvertError(f"{profile}: no such usage profile (.coli_usage)")
    shape = (max(layout.moe_layers) + 1, layout.n_experts)
    text = profile.read_text(encoding="utf-8", errors="replace")
    return parse_counts(text, profile, shape, str(ckpt.config.get("model_type", "")))


def requant(
    model: Path,
    dst: Path,
    profile: Path,
    opts: HeatOptions,
    *,
    source: Path | None = None,
    quiet: bool = True,
    say=lambda msg: None,  # type: ignore[no-untyped-def]
) -> RequantResult:
    """Write the by-heat container ``dst`` from the container ``model`` (module doc)."""
    from colibrid.engine.layout import expert_layout
    from colibrid.models import family

    opts.check()
    if not (model / MANIFEST_NAME).is_file():
        raise ConvertError(
            f"{model}: not a colibri container (no {MANIFEST_NAME}); convert the checkpoint "
            "first (`colibri convert`), then requant the container"
        )
    ckpt = Checkpoint.open(model)
    src: Source | None = None
    try:
        args = family(ckpt.config.get("model_type")).ModelArgs.from_config(ckpt.config)
        layout = expert_layout(args, ckpt)
        counts = load_profile(profile, ckpt, layout)
        heat = plan_by_heat(counts, layout.profiled_layers, layout.n_experts, opts)
        if heat.selections == 0:
            raise ConvertError(f"{profile}: no selections recorded for this model's layers")
        manifest = json.loads((model / MANIFEST_NAME).read_text())
        base = manifest.get("params") if isinstance(manifest.get("params"), dict) else {}
        params = ConvertParams(
            **{k: v for k, v in base.items() if k in ConvertParams.__dataclass_fields__}
        )
        hint = params.group_size or None
        if source is not None:
            from colibrid.convert.source import Source

            src = Source.open(source)
            src_tensors = {t.name: t for t in src.tensors}
        targets: dict[tuple[int, int], dict[str, Target]] = {}
        kept = 0
        for key, bits in heat.bits.items():
            per: dict[str, Target] = {}
            raised = False
            for proj in PROJECTIONS:
                name = layout.tensor_name(key[0], key[1], proj)
                stored = stored_label(ckpt, name, layout.shape(proj))
                fmt = weight_format(bits)
                gs = params.group_size if fmt is WeightFormat.Q4 else 64 if bits < 4 else 0
                want = Target(False, fmt, gs)
                same = stored == _label_of(want)
                if same or (src is None and bits > label_bits(stored)):
                    raised |= not same
                    per[proj] = Target(True)
                else:
                    if src is not None and name not in src_tensors:
                        raise ConvertError(f"{source}: has no tensor {name!r} (another model?)")
                    per[proj] = want
            kept += raised
            targets[key] = per
        units = plan_units(ckpt, layout, targets, Signatures(), hint)
        shards = pack(units, params.shard_bytes, hint)
        fingerprint = [
            "colibri-requant 1",
            opts.to_json(),
            sha256_of(profile),
            str(model.resolve()),
            sha256_of(model / MANIFEST_NAME),
            None if src is None else src.fingerprint(),
        ]
        state = prepare_dst(dst, params, fingerprint)
        plain = [s for s, _ in shards]
        if not state.get("complete"):
            members = {s.name: m for s, m in shards}

            def chunks_of(shard: Shard) -> Iterator[tuple[str, np.ndarray]]:
                for unit in members[shard.name]:
                    yield from _unit_chunks(unit, ckpt, layout, targets, src)

            written, _ = run_shards(dst, plain, state, chunks_of, quiet=quiet)
            for name in SIDE_FILES:
                if (model / name).is_file():
                    write_atomic(dst / name, (model / name).read_bytes())
            plan_id = _written_plan_id(dst, ckpt.config, layout)
            finish(
                dst,
                plain,
                state,
                {"precision_plan": _record(plan_id, heat, opts, profile, model, source)},
            )
        else:
            written = 0
            plan_id = json.loads((dst / MANIFEST_NAME).read_text())["precision_plan"]["id"]
        return RequantResult(dst, plan_id, heat, kept, written)
    finally:
        if src is not None:
            src.close()
        ckpt.close()


def _label_of(target: Target) -> str:
    from colibrid.store.precision_plan import format_label

    name = intended_format(target)
    return format_label(name, target.group_size if name != INT8_ROW else 0)


def _unit_chunks(
    unit: Unit,
    ckpt: Checkpoint,
    layout: ExpertLayout,
    targets: dict[tuple[int, int], dict[str, Target]],
    src: Source | None,
) -> Iterator[tuple[str, np.ndarray]]:
    if unit.expert is None:
        for e in unit.entries:
            yield e.name, ckpt.raw(e.name)
        return
    layer, expert = unit.expert
    data: list[tuple[str, np.ndarray]] = []
    scales: list[tuple[str, np.ndarray]] = []
    for proj in FILE_ORDER:
        name = layout.tensor_name(layer, expert, proj)
        target = targets[unit.expert][proj]
        if target.copy:
            data.append((name, ckpt.raw(name)))
            if ckpt.has(name + ".qs"):
                scales.append((name + ".qs", ckpt.raw(name + ".qs")))
            continue
        assert target.fmt is not None
        if src is None:
            w = quant.dequantize(ckpt.weight(name, layout.shape(proj)))
        else:
            t = next(t for t in src.tensors if t.name == name)
            w = np.concatenate(list(src.rows(t)), axis=0)
        tensors = quant.container_tensors(name, quant.quantize(w, target.fmt, target.group_size))
        data.append((name, tensors[name].view(np.uint8)))
        scales.append((name + ".qs", tensors[name + ".qs"]))
    yield from data
    yield from scales


def _written_plan_id(dst: Path, config: dict, layout: ExpertLayout) -> str:
    """The plan id as the loader will compute it, from the shards just written (the
    folder is not complete yet, so opened without Checkpoint.open's refusal)."""
    from colibrid.store.checkpoint_files import _glob_files
    from colibrid.store.safetensors_file import SafetensorsFile

    files = [SafetensorsFile.open(p) for p in _glob_files(dst)]
    ckpt = Checkpoint(dst, config, files)
    try:
        return plan_of(ckpt, layout).id
    finally:
        ckpt.close()


def _record(
    plan_id: str, heat: HeatPlan, opts: HeatOptions, profile: Path, model: Path, source: Path | None
) -> dict:
    layers: dict[str, list[int]] = {}
    for (layer, _expert), bits in sorted(heat.bits.items()):
        layers.setdefault(str(layer), []).append(bits)
    return {
        "id": plan_id,
        "by": "heat",
        "options": opts.to_json(),
        "profile": str(profile),
        "profile_sha256": sha256_of(profile),
        "cold_traffic": heat.cold_traffic,
        "hot_traffic": heat.hot_traffic,
        "selections": heat.selections,
        "bits": layers,  # per layer, the bits of expert 0, 1, ...
        "from": {
            "model": str(model.resolve()),
            "model_manifest_sha256": sha256_of(model / MANIFEST_NAME),
            "source": None if source is None else str(source.resolve()),
        },
    }


# ---- --max-kl ---------------------------------------------------------------------------


def pick_by_kl(
    model: Path,
    dst: Path,
    profile: Path,
    opts: HeatOptions,
    max_kl: float,
    reference: Path,
    *,
    source: Path | None,
    say,  # type: ignore[no-untyped-def]
) -> tuple[RequantResult, list[dict]]:
    """Candidates at increasing cold shares (MAX_KL_SHARES that fit beside the hot
    share), each written beside ``dst`` and scored against ``reference``; the largest
    share whose mean KL is at most ``max_kl`` becomes ``dst``, the others are removed.
    The trials stop at the first share over the bound (KL grows with the share)."""
    from colibrid.quality.evaluate import EvalSettings, build_reference, score_model

    ref = build_reference(reference, EvalSettings(), say)
    trials: list[dict] = []
    best: tuple[RequantResult, Path] | None = None
    for share in (s for s in MAX_KL_SHARES if s + opts.hot_share <= 1.0 + 1e-9):
        trial = dst.with_name(f".{dst.name}.cold-{share:g}")
        shutil.rmtree(trial, ignore_errors=True)
        result = requant(model, trial, profile, replace(opts, cold_share=share), source=source)
        summary = score_model(trial, ref, lambda m: None).scores.summary()
        ok = summary["kl_mean"] <= max_kl
        trials.append({"cold_share": share, "plan": result.plan_id, **summary, "kept": ok})
        say(
            f"cold share {share:g}: mean KL {summary['kl_mean']:.6f} "
            + ("<=" if ok else ">")
            + f" {max_kl:g}"
        )
        if not ok:
            shutil.rmtree(trial, ignore_errors=True)
            break
        if best is not None:
            shutil.rmtree(best[1], ignore_errors=True)
        best = (result, trial)
    if best is None:
        raise ConvertError(
            f"no cold share keeps the mean KL at or under {max_kl:g} (the smallest, "
            f"{MAX_KL_SHARES[0]:g}, gave {trials[0]['kl_mean']:.6f}); nothing written"
        )
    result, trial = best
    try:
        trial.rename(dst)
    except OSError as exc:
        raise ConvertError(
            f"{dst}: cannot move the chosen plan into place ({exc.strerror})"
        ) from None
    return replace(result, dst=dst), trials


def default_dst(model: Path, opts: HeatOptions) -> Path:
    """``<MODEL>-heat-c<cold share>q<cold bits>`` beside MODEL: installed models get an
    installed variant that `colibri list` shows and `colibri run` loads by name."""
    tag = f"heat-c{round(100 * opts.cold_share)}q{opts.cold_bits}"
    if opts.hot_share:
        tag += f"-h{round(100 * opts.hot_share)}q{opts.hot_bits}"
    return model.with_name(f"{model.name}-{tag}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colibri requant",
        description="Write a new container whose routed experts carry precisions chosen "
        "from a usage profile: per MoE layer the experts are ranked by how often the "
        "profile selected them; the hottest --hot-share of them get --hot-bits, the "
        "coldest --cold-share get --cold-bits, the rest --bits. MODEL is never changed "
        "(using it again undoes the plan). Lossy and opt-in; measure it with `colibri "
        "eval`. Re-running with the same options resumes.",
    )
    p.add_argument("model", metavar="MODEL", help="installed model name or container folder")
    p.add_argument(
        "--by-heat",
        required=True,
        metavar="PROFILE",
        help="a .coli_usage file, or the name of one of MODEL's profiles "
        "($COLIBRI_HOME/profiles/MODEL/NAME.coli_usage)",
    )
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="DST",
        help="new container folder (default: beside MODEL, named MODEL-heat-c<share>q<bits>)",
    )
    p.add_argument(
        "--hot-share",
        type=float,
        default=0.0,
        help="share of each layer's experts that are hot (0)",
    )
    p.add_argument(
        "--hot-bits", type=int, default=8, choices=BITS, help="bits of the hot experts (8)"
    )
    p.add_argument(
        "--cold-share",
        type=float,
        default=0.5,
        help="share of each layer's experts that are cold (0.5)",
    )
    p.add_argument(
        "--cold-bits", type=int, default=3, choices=BITS, help="bits of the cold experts (3)"
    )
    p.add_argument("--bits", type=int, default=4, choices=BITS, help="bits of the others (4)")
    p.add_argument(
        "--source",
        type=Path,
        metavar="CKPT",
        help="the checkpoint MODEL was converted from: changed experts are quantised from "
        "its full precision (without it, from MODEL's stored weights)",
    )
    p.add_argument(
        "--max-kl",
        type=float,
        metavar="X",
        help="try cold shares 0.125, 0.25, ... and keep the largest whose mean KL against "
        "--against stays <= X (replaces --cold-share)",
    )
    p.add_argument(
        "--against",
        metavar="REF",
        help="the reference --max-kl measures against (default: --source, else MODEL)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def _profile_path(arg: str, model: Path) -> Path:
    path = Path(arg)
    if path.is_file() or arg.endswith(".coli_usage") or "/" in arg:
        return path
    from colibrid.paths import Paths

    return Paths.from_env().home / "profiles" / model.name / f"{arg}.coli_usage"


def main(argv: Sequence[str]) -> int:
    from colibrid.quality.command import resolve_model

    a = build_parser().parse_args(list(argv))

    def say(msg: str) -> None:
        if not a.quiet:
            print(f"colibri requant: {msg}", file=sys.stderr, flush=True)

    try:
        model = resolve_model(a.model)
        profile = _profile_path(a.by_heat, model)
        opts = HeatOptions(a.hot_share, a.hot_bits, a.cold_share, a.cold_bits, a.bits)
        opts.check()
        dst = a.output or default_dst(model, opts)
        trials: list[dict] = []
        if a.max_kl is not None:
            if not a.max_kl > 0:
                raise ConvertError(f"--max-kl {a.max_kl}: a positive bound in nats")
            if a.output is None:
                dst = model.with_name(f"{model.name}-heat-kl{a.max_kl:g}")
            if dst.exists():
                raise ConvertError(f"{dst}: exists; --max-kl writes a new folder")
            ref = resolve_model(a.against) if a.against else a.source or model
            r, trials = pick_by_kl(
                model, dst, profile, opts, a.max_kl, ref, source=a.source, say=say
            )
        else:
            r = requant(model, dst, profile, opts, source=a.source, quiet=a.quiet, say=say)
    except ColibriError as exc:
        print(f"colibri requant: error: {exc}", file=sys.stderr)
        return 1
    heat = r.heat
    chosen = next((t for t in reversed(trials) if t["kept"]), None)
    report = {
        "dst": str(r.dst),
        "plan": r.plan_id,
        "experts_by_bits": {str(b): heat.count(b) for b in BITS if heat.count(b)},
        "cold_traffic": heat.cold_traffic,
        "hot_traffic": heat.hot_traffic,
        "kept_stored": r.kept_stored,
        "trials": trials,
    }
    if a.json:
        print(json.dumps(report, indent=1, sort_keys=True))
        return 0
    by_bits = ", ".join(f"{n} at {b} bits" for b, n in report["experts_by_bits"].items())
    print(f"{r.dst}: plan {r.plan_id}: {by_bits}")
    print(
        f"the cold experts carried {100 * heat.cold_traffic:.1f}% of the profile's "
        f"{heat.selections} selections, the hot ones {100 * heat.hot_traffic:.1f}%"
    )
    if chosen is not None:
        print(
            f"--max-kl {a.max_kl:g}: chose cold share {chosen['cold_share']:g} "
            f"(mean KL {chosen['kl_mean']:.6f}, top-1 {100 * chosen['top1_agreement']:.2f}%)"
        )
    if r.kept_stored:
        print(
            f"note: {r.kept_stored} experts planned above their stored precision keep it "
            "(more bits of a quantised weight are the same weight; --source CKPT raises them)"
        )
    print(f"measure it: colibri eval {r.dst} --against {a.source or model}")
    return 0
