"""`hf2q convert`: the text model (`checkpoint/convert.py`) or, with `--mmproj`, the vision projector
(`checkpoint/convert_mmproj.py`)."""
from __future__ import annotations

from pathlib import Path

from hf2q.checkpoint.convert import OUTTYPES, convert
from hf2q.checkpoint.convert_mmproj import convert_mmproj


def add_convert_args(parser) -> None:
    """Arguments of `hf2q convert HF_DIR -o OUT.gguf --outtype f32|f16|bf16|q8_0 [--no-mtp] [--mmproj]`."""
    parser.add_argument("hf_dir", type=Path, metavar="HF_DIR", help="HF checkpoint folder")
    parser.add_argument("-o", "--outfile", type=Path, required=True, metavar="OUT.gguf")
    parser.add_argument("--outtype", choices=OUTTYPES, default="f32")
    parser.add_argument("--no-mtp", action="store_true", help="leave out the MTP (nextn) layer")
    parser.add_argument("--mmproj", action="store_true",
                        help="write the vision projector (llama.cpp's mmproj file, --outtype f32 or f16) instead")


def run_convert(args) -> int:
    if args.mmproj:
        path = convert_mmproj(args.hf_dir, args.outfile, args.outtype)
    else:
        path = convert(args.hf_dir, args.outfile, args.outtype, args.no_mtp)
    print(f"wrote {path}")
    return 0
