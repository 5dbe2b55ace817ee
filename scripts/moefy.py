"""Dense target -> MoE whose experts specialise, with a realness report (shim over specdistill.cli.moefy, also
installed as `specdistill-moefy`).

  python scripts/moefy.py --experts 8 --top-k 2 --out ~/.cache/specdistill/models/smollm2-135m-moefied-e8k2
"""
from specdistill.cli.moefy import main

if __name__ == "__main__":
    main()
