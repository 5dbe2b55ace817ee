"""Export a trained EAGLE-3 head (shim over specdistill.cli.export, also installed as `specdistill-export`).

  python scripts/export.py --draft <checkpoint>/draft --format vllm --target <target> --out <dir>
"""
import sys

from specdistill.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
