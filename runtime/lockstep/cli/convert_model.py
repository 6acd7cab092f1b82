"""`lockstep convert-model SRC --dest DIR --precision fp8|mxfp8|nvfp4 [--bf16-modules P ...]`.

Why it exists: stage 1 of the low-precision contract (§6) in a cluster. Engine pods must serve the
checkpoint converted by the job's recipe (the shared quantizer, the same BF16 exceptions as every
push), in the layout SGLang's loaders read (`quantization_config` in config.json; FP8 `weight` plus
`weight_scale_inv`, ModelOpt NVFP4 `weight` plus `weight_scale`/`weight_scale_2`). The operator's
init step of every engine pod runs exactly this command into the job's serving volume; by hand it
prepares a serving checkpoint once.

Contract: SRC is an HF-layout directory (the model volume's copy of a hub checkpoint, or a local
path); DIR is written atomically (converted into a sibling temp directory, then renamed), so engine
pods sharing one volume never read a half-written checkpoint, and a DIR already there is kept (the
conversion is deterministic: any pod would write the same bytes). Exit 0 with one line naming DIR;
exit 2 with a message naming the argument and the fix.

Who calls it: the operator's engine-pod init step (lockstep_operator.resources.model), users.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from lockstep.cli.commands import HELP
from lockstep.numerics.quant import Format, Scheme
from lockstep.numerics.recipe import Recipe, convert_checkpoint


def register(sub: Any) -> None:
    p = sub.add_parser("convert-model", help=HELP["convert-model"], description=__doc__.split("\n\n")[1])
    p.add_argument("src", metavar="SRC", type=Path, help="HF-layout checkpoint directory (bf16/fp32)")
    p.add_argument("--dest", type=Path, required=True, help="directory the serving checkpoint is written to")
    p.add_argument(
        "--precision", required=True, choices=["fp8", "mxfp8", "nvfp4"], help="spec.rollout.precision"
    )
    p.add_argument(
        "--bf16-modules",
        nargs="*",
        default=[],
        metavar="PATTERN",
        help="spec.model.bf16Modules: fnmatch patterns of module names kept in BF16",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    src, dest = Path(args.src), Path(args.dest)
    if not (src / "config.json").is_file() or not any(src.glob("*.safetensors")):
        print(
            f"error: SRC {src}: not an HF-layout checkpoint (config.json and *.safetensors); point it at the "
            "model volume's directory or a local checkpoint",
            file=sys.stderr,
        )
        return 2
    if (dest / "config.json").is_file():
        print(f"serving checkpoint {dest} is already there (converted by another pod); kept")
        return 0
    recipe = Recipe(Scheme.of(Format(args.precision)), tuple(args.bf16_modules))
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert_checkpoint(src, tmp, recipe)
        try:
            tmp.rename(dest)
        except OSError:
            if not (dest / "config.json").is_file():
                raise
            print(f"serving checkpoint {dest} appeared meanwhile (another pod); kept")
            return 0
    except (OSError, ValueError) as e:
        print(f"error: converting {src} to {args.precision}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"converted {src} to {args.precision} into {dest}")
    return 0
