"""``hvd-partialfc-shards``: build, inspect and turn into verification pairs shard sets, offline.

    hvd-partialfc-shards build FORMAT [SOURCE] --out DIR --num-shards N [--balance classes|samples]
        [--store raw|encoded] [--size H[,W]] [--color gray|rgb] [--on-error fail|skip] [--workers W]
        [--holdout F --holdout-out DIR2 --holdout-shards K] [--seed S] [--overwrite]
        [--compression none|gzip|lzf] [--chunk-samples K] [--part K/M]
        fonts only: [--charset gb2312-1|jis-1|cjk|FILE] [--samples-per-font K] [--font-dir D]
                    [--max-fonts K] [--max-chars K] [--min-fonts K] [--min-families K]
                    [--faces-per-family K] [--near-duplicate T] [--min-samples N] [--font-list FILE]
    hvd-partialfc-shards assemble OUT [--overwrite]   (after a build in parts)
    hvd-partialfc-shards inspect DIR [--json] [--no-sha256] [--plot FILE.png] [--decode [--workers W]]
    hvd-partialfc-shards pairs SHARDS_DIR --out pairs.h5|pairs.bin --num-pairs P [--seed S] [--bin]
    hvd-partialfc-shards pairs FILE.bin|FILE.h5 --out OTHER.h5|OTHER.bin      (conversion)
    hvd-partialfc-shards ijb SHARDS_DIR --out DIR [--name IJBC|IJBB] [--templates K] [--impostor-pairs P]
        [--seed S] [--overwrite]               (an IJB-shaped set: `hvd-partialfc eval --ijb DIR`)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional


def _size(text: str) -> List[int]:
    parts = [int(p) for p in text.replace("x", ",").split(",") if p]
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"--size expects S or H,W, got {text!r}")
    return parts


def _build(args) -> int:
    from .build import BuildOptions, build
    from .importers import get_importer
    from .storage import default_workers
    opts = BuildOptions(out=args.out, num_shards=args.num_shards, balance=args.balance, store=args.store,
                        size=args.size, color=args.color, on_error=args.on_error,
                        workers=args.workers or default_workers(), seed=args.seed, holdout=args.holdout,
                        holdout_out=args.holdout_out, holdout_shards=args.holdout_shards,
                        overwrite=args.overwrite,
                        compression=None if args.compression == "none" else args.compression,
                        chunk_samples=args.chunk_samples, check=not args.no_check)
    fonts = dict(charset=args.charset, samples_per_font=args.samples_per_font, font_dir=args.font_dir,
                 max_fonts=args.max_fonts, max_chars=args.max_chars, min_fonts=args.min_fonts,
                 min_families=args.min_families, faces_per_family=args.faces_per_family,
                 near_duplicate=args.near_duplicate, min_samples=args.min_samples, font_list=args.font_list)
    if args.format != "fonts" and args.source is None:
        raise ValueError(f"build {args.format}: SOURCE is required")
    from .stream import build_streaming
    from .stream_index import INDEXERS
    from .stream_plan import parse_part
    if args.format in INDEXERS:
        part = parse_part(args.part)           # streaming: bounded memory, restartable, parts (data_tools/stream.py)
        r = build_streaming(args.format, args.source, opts, part)
        if r["already"]:
            print(f"{args.out}: already built by this command (same inputs and options as its fingerprint.json); "
                  f"nothing to do")
            return 0
        print(f"part {part[0]}/{part[1]}: wrote {r['shards_written']} shards ({r['samples_written']} samples), "
              f"{r['shards_resumed']} already done; index {r['index_bytes_per_sample']:.1f} bytes/sample, "
              f"{r['index_seconds']:.1f} s{' (saved by an earlier run)' if r['index_cached'] else ''}")
        if r["manifest"] is None:
            print(f"when every part has finished: hvd-partialfc-shards assemble {args.out}")
            return 0
    elif args.part:         # a launcher's rank alone does not split an in-memory build: it builds it all
        raise ValueError(f"--part: build {args.format} holds its samples in memory and cannot be split; "
                         f"--part works with {', '.join(sorted(INDEXERS))}")
    else:
        r = build(get_importer(args.format), args.source, opts, **(fonts if args.format == "fonts" else {}))
    _print_written(r, args.out, opts.holdout_out)
    src = r["manifest"].source
    if args.format == "fonts":
        print(f"fonts: {src['faces_used']} faces of {src['families_used']} families ({src['family_keys_used']} "
              f"family keys) used ({src['faces_found']} found), {src['duplicate_renderings_dropped']} duplicate "
              f"and {src['standin_renderings_dropped']} stand-in renderings dropped, "
              f"{src['near_duplicate_renderings_dropped']} near duplicates, {src['top_up_samples']} top-up samples, "
              f"{src['characters_dropped']} characters without enough fonts or families")
        print("characters by family keys with a distinct rendering: "
              + ", ".join(f"{n}: {c}" for n, c in enumerate(src["family_histogram"]) if c))
    skipped = r.get("skipped", len(r["manifest"].skipped) + (len(r["holdout"].skipped) if r["holdout"] else 0))
    if skipped:
        print(f"skipped {skipped} unreadable samples (listed in the manifest's 'skipped')")
    print(f"build time {r['seconds']:.1f} s ({r['samples_per_s']:.0f} samples/s)")
    return 0


def _print_written(r, out, holdout_out) -> None:
    for m, path in ((r["manifest"], out), (r["holdout"], holdout_out)):
        if m is None:
            continue
        p = m.partition
        print(f"wrote {path}: {m.num_shards} shards, {m.num_classes} classes, {m.num_samples} samples "
              f"({m.kind} {m.sample_shape}); sample imbalance (max/mean) {p['sample_imbalance']:.3f} "
              f"with --balance {p['policy']} (by classes: {p['sample_imbalance_by_classes']:.3f})")


def _assemble(args) -> int:
    from .assemble import assemble
    r = assemble(args.out, overwrite=args.overwrite)
    if r["already"]:
        print(f"{args.out}: already assembled (every set of the build is in place); nothing to do")
        return 0
    _print_written(r, args.out, r["holdout"] and os.path.normpath(
        os.path.join(args.out, r["manifest"].source["holdout"]["path"])))
    return 0


def inspect_shard_set(path: str, verify_sha256: bool = True) -> dict:
    """Validate a shard set (manifest, label ranges, every label, counts, sha256) and summarise it."""
    from hvd_partialfc.data.partition import imbalance
    from hvd_partialfc.data.shards import ShardError, check_shard_file, open_shard, read_manifest, read_shard_labels
    m = read_manifest(path)
    rows = []
    for i, s in enumerate(m.shards):
        check_shard_file(path, m, i, verify_sha256=verify_sha256)
        file = os.path.join(path, s.file)
        with open_shard(file) as f:
            shape = list(f[m.kind].shape[1:])
        present = len(set(read_shard_labels(file).tolist()))
        if m.kind != "encoded" and shape != list(m.sample_shape):
            raise ShardError(f"{s.file}: sample shape {shape}, manifest says {m.sample_shape}")
        if present != s.label_end - s.label_start:
            raise ShardError(f"{s.file}: {present} of its {s.label_end - s.label_start} classes have samples")
        rows.append({"file": s.file, "label_start": s.label_start, "label_end": s.label_end,
                     "classes": s.label_end - s.label_start, "samples": s.num_samples})
    return {"path": path, "num_classes": m.num_classes, "num_samples": m.num_samples, "kind": m.kind,
            "sample_shape": m.sample_shape, "partition": m.partition, "shards": rows,
            "sample_imbalance": imbalance([r["samples"] for r in rows]),
            "class_imbalance": imbalance([r["classes"] for r in rows]), "skipped": len(m.skipped)}


def plot_shards(info: dict, path: str) -> None:
    """Bar charts of samples and classes per shard, with the mean, into ``path`` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = info["shards"]
    x = list(range(len(rows)))
    fig, axes = plt.subplots(1, 2, figsize=(max(6, 0.25 * len(rows) + 4), 3.2))
    for ax, key, title in ((axes[0], "samples", "samples per shard"), (axes[1], "classes", "classes per shard")):
        vals = [r[key] for r in rows]
        ax.bar(x, vals, color="#4c72b0")
        ax.axhline(sum(vals) / len(vals), color="#c44e52", lw=1, label="mean")
        ax.set_title(f"{title} (max/mean {info['sample_imbalance' if key == 'samples' else 'class_imbalance']:.3f})",
                     fontsize=9)
        ax.set_xlabel("shard")
        ax.legend(fontsize=8)
    fig.suptitle(f"{os.path.basename(os.path.abspath(info['path']))}: {info['num_classes']} classes, "
                 f"{info['num_samples']} samples, balance={info['partition'].get('policy')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _inspect(args) -> int:
    info = inspect_shard_set(args.dir, verify_sha256=not args.no_sha256)
    if args.plot:
        plot_shards(info, args.plot)
    if args.decode:
        from .decode_scan import rebuild_command, undecodable
        from .storage import default_workers
        from hvd_partialfc.data.shards import read_manifest
        info["undecodable"] = undecodable(args.dir, args.workers or default_workers(), progress=not args.json)
        info["rebuild"] = rebuild_command(read_manifest(args.dir), args.dir) if info["undecodable"] else ""
    if args.json:
        print(json.dumps(info, indent=1))
        return 1 if info.get("undecodable") else 0
    print(f"{info['path']}: {info['num_classes']} classes, {info['num_samples']} samples, {info['kind']} "
          f"{info['sample_shape']}, {len(info['shards'])} shards: valid")
    for r in info["shards"]:
        print(f"  {r['file']}  labels [{r['label_start']}, {r['label_end']})  {r['classes']} classes  {r['samples']} samples")
    print(f"  imbalance (max/mean): samples {info['sample_imbalance']:.3f}, classes {info['class_imbalance']:.3f}")
    if info["skipped"]:
        print(f"  {info['skipped']} samples were skipped at build time (manifest 'skipped')")
    if args.plot:
        print(f"  plot: {args.plot}")
    return _print_undecodable(info) if args.decode else 0


def _print_undecodable(info: dict) -> int:
    """The ``--decode`` listing; 1 when a sample does not decode (for scripts), else 0."""
    bad = info["undecodable"]
    if not bad:
        print(f"  every one of the {info['num_samples']} samples decodes")
        return 0
    print(f"  {len(bad)} of the {info['num_samples']} samples cannot be decoded:")
    for r in bad:
        print(f"    {r['file']}: sample {r['sample']} (label {r['label']}, {r['bytes']} bytes): {r['reason']}")
    print(f"  rebuild without them (the build decodes every image and leaves these out; add the set's other "
          f"build options):\n    {info['rebuild']}\n  or train on this set with data.on_bad_sample=skip "
          f"(each replaced by the next decodable sample of its class)")
    return 1


def _pairs(args) -> int:
    from .pair_sets import convert_pairs, make_pairs
    out = args.out
    if args.bin and not out.endswith(".bin"):
        raise ValueError("--bin: the output name must end in .bin")
    if os.path.isdir(args.source):
        if args.num_pairs is None:
            raise ValueError("pairs from a shard set need --num-pairs")
        r = make_pairs(args.source, out, args.num_pairs, args.seed, as_bin=args.bin)
    else:
        r = convert_pairs(args.source, out)
    print(f"wrote {r['out']}: {r['pairs']} pairs ({r['same']} same), {r['images']} images")
    return 0


def _ijb(args) -> int:
    from .ijb_glyphs import glyph_ijb_from_shards
    r = glyph_ijb_from_shards(args.source, args.out, name=args.name, seed=args.seed, templates=args.templates,
                              impostor_pairs=args.impostor_pairs, overwrite=args.overwrite)
    print(f"wrote {args.out}: {r['name']} layout, {r['classes']} classes, {r['templates']} templates, {r['media']} "
          f"media, {r['images']} images, {r['same_pairs']} same and {r['different_pairs']} different template pairs")
    return 0


EXAMPLES = {
    "build": ["hvd-partialfc-shards build imagefolder faces/ --out shards/train --num-shards 64 --store encoded "
              "--size 112",
              "hvd-partialfc-shards build recordio ms1m-retinaface-t1/train --out shards/train --num-shards 64 "
              "--store encoded"],
    "assemble": ["hvd-partialfc-shards assemble shards/train      # after every --part K/M of the build"],
    "inspect": ["hvd-partialfc-shards inspect shards/train",
                "hvd-partialfc-shards inspect shards/train --plot shards.png"],
    "pairs": ["hvd-partialfc-shards pairs data/fonts-gb2312-holdout --out pairs.h5 --num-pairs 6000 --seed 0",
              "hvd-partialfc-shards pairs val/lfw.bin --out lfw.h5"],
    "ijb": ["hvd-partialfc-shards ijb data/fonts-gb2312-holdout --out ijb-glyphs --name IJBC",
            "hvd-partialfc eval --backbone runs/demo --ijb ijb-glyphs --ijb-name IJBC --ijb-no-flip"],
}


def _build_subcommand(sub) -> None:
    """build: its common options, then the fonts importer's own group."""
    from .importers import list_importers
    b = sub.add_parser("build", help="write a shard set from a source")
    b.add_argument("format", choices=list_importers())
    b.add_argument("source", nargs="?", help="folder, list file, npz, RecordIO prefix (fonts: none)")
    b.add_argument("--out", required=True)
    b.add_argument("--num-shards", type=int, required=True)
    b.add_argument("--balance", choices=["classes", "samples"], default="classes")
    b.add_argument("--store", choices=["raw", "encoded"], default="raw")
    b.add_argument("--size", type=_size, help="sample size S or H,W (fonts: square side, default 64)")
    b.add_argument("--color", choices=["gray", "rgb"], help="image files: default the first image's")
    b.add_argument("--on-error", choices=["fail", "skip"], default="fail")
    b.add_argument("--no-check", action="store_true",
                   help="--store encoded (recordio, list, imagefolder): keep the bytes without decoding each image "
                        "to check it (disk-bound; a broken image then fails at training time, naming it)")
    b.add_argument("--workers", type=int, default=0, help="processes (default: all cores)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--holdout", type=float, default=0.0, help="fraction of classes held out")
    b.add_argument("--holdout-out", help="held-out shard set (default OUT-holdout)")
    b.add_argument("--holdout-shards", type=int, default=1)
    b.add_argument("--overwrite", action="store_true")
    b.add_argument("--compression", choices=["none", "gzip", "lzf"], default="none")
    b.add_argument("--chunk-samples", type=int, default=0,
                   help="HDF5 chunk length in samples; 0 = contiguous (fastest random reads, measured)")
    b.add_argument("--part", help="K/M: write only part K (from 1) of M of the shards (recordio, list, "
                   "imagefolder); default: the launcher's rank/size (Open MPI, PMI, Slurm tasks or array); "
                   "then `assemble OUT`")
    _fonts_arguments(b.add_argument_group("fonts"))
    b.set_defaults(fn=_build)


def _fonts_arguments(f) -> None:
    """build's options that only the fonts importer reads."""
    f.add_argument("--charset", default="gb2312-1", help="gb2312-1, jis-1, cjk (U+4E00-9FFF and U+3400-4DBF), "
                   "or a UTF-8 file of characters")
    f.add_argument("--samples-per-font", type=int, default=1)
    f.add_argument("--font-dir")
    f.add_argument("--max-fonts", type=int, help="first K font families")
    f.add_argument("--font-list", metavar="FILE", help="render only the faces FILE names, one 'Family' or "
                   "'Family:Style' a line; a name not installed is an error (configs/demo_fonts.txt: the demo's)")
    f.add_argument("--max-chars", type=int)
    f.add_argument("--min-fonts", type=int, default=1, help="drop characters with fewer distinct renderings")
    f.add_argument("--min-families", type=int, default=1,
                   help="drop characters whose distinct renderings come from fewer family keys")
    f.add_argument("--faces-per-family", type=int, default=0,
                   help="render at most K faces per family key (Regular first); 0 = all")
    f.add_argument("--near-duplicate", type=float, default=0.0,
                   help="also drop a rendering within T (mean abs. difference 0-255, shifts <= 1 px) of an "
                        "earlier one of the character; 0 = only pixel-equal ones")
    f.add_argument("--min-samples", type=int, default=0,
                   help="top every kept character up to N samples with augmented renderings")


def _shard_set_parsers(sub) -> None:
    """assemble and inspect: the subcommands that finish or check a written shard set."""
    a = sub.add_parser("assemble", help="write the manifests of a build done in parts (--part K/M)")
    a.add_argument("out", help="the --out of the build")
    a.add_argument("--overwrite", action="store_true", help="replace an existing set at OUT (or its held-out "
                   "set's place) that is not this build's")
    a.set_defaults(fn=_assemble)
    i = sub.add_parser("inspect", help="validate a shard set and print its per-shard figures")
    i.add_argument("dir")
    i.add_argument("--json", action="store_true")
    i.add_argument("--no-sha256", action="store_true", help="skip hashing the shard files")
    i.add_argument("--plot", help="write a per-shard distribution plot (PNG)")
    i.add_argument("--decode", action="store_true",
                   help="encoded sets: decode every sample, list those that fail and the build without them "
                        "(exit status 1 when there are some)")
    i.add_argument("--workers", type=int, default=0, help="--decode: processes (default: all cores)")
    i.set_defaults(fn=_inspect)


def _evaluation_set_parsers(sub) -> None:
    """pairs and ijb: the subcommands that turn held-out classes into evaluation sets."""
    q = sub.add_parser("pairs", help="verification pairs from held-out classes; .bin/.h5 conversion")
    q.add_argument("source", help="a shard set (held-out classes), or a .bin/.h5 pair file to convert")
    q.add_argument("--out", required=True, help=".h5 (hvd_partialfc pair set) or .bin (LFW style)")
    q.add_argument("--num-pairs", type=int)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--bin", action="store_true", help="write the LFW-style .bin")
    q.set_defaults(fn=_pairs)
    j = sub.add_parser("ijb", help="an IJB-B/C-shaped set (loose crops, landmarks, templates) from held-out classes")
    j.add_argument("source", help="a shard set of aligned images (held-out classes)")
    j.add_argument("--out", required=True, help="the folder `hvd-partialfc eval --ijb` reads")
    j.add_argument("--name", default="IJBC", type=str.upper, choices=["IJBC", "IJBB"], help="names the meta files")
    j.add_argument("--templates", type=int, default=3, help="templates per class")
    j.add_argument("--impostor-pairs", type=int, default=100_000, help="different-class template pairs")
    j.add_argument("--seed", type=int, default=0)
    j.add_argument("--overwrite", action="store_true")
    j.set_defaults(fn=_ijb)


def build_parser() -> argparse.ArgumentParser:
    from hvd_partialfc.cli_support import finish_subcommands
    p = argparse.ArgumentParser(prog="hvd-partialfc-shards", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Examples:\n  " + EXAMPLES["build"][0] + "\n  " + EXAMPLES["inspect"][0]
                                       + "\n  hvd-partialfc-shards SUBCOMMAND --help")
    sub = p.add_subparsers(dest="cmd", required=True)
    _build_subcommand(sub)
    _shard_set_parsers(sub)
    _evaluation_set_parsers(sub)
    finish_subcommands("hvd-partialfc-shards", sub, EXAMPLES)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """A user's mistake (bad input: ValueError, a missing or unreadable file: OSError) is one line and exit 2;
    --debug or HVD_PARTIALFC_DEBUG=1 adds its traceback; anything else is a bug and keeps its traceback."""
    from hvd_partialfc.cli_support import run_command
    args = build_parser().parse_args(argv)
    return run_command("hvd-partialfc-shards", args, args.fn, (ValueError, OSError))


if __name__ == "__main__":
    sys.exit(main())
