"""Regenerate a conversation set's answers with the target (shim over specdistill.cli.regenerate, also installed as
`specdistill-regenerate`).

  python scripts/regenerate.py --data embedded:sharegpt --max-rows 2000 --out data/sharegpt_smollm2.jsonl
"""
from specdistill.cli.regenerate import main

if __name__ == "__main__":
    main()
