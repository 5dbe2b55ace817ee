r"""`specdistill-export`: a trained draft written in a serving format of its kind (an EAGLE-3 head: vLLM, SGLang
(midlayer format) or vllm-project/speculators; a DFlash drafter: vLLM), or an export validated (--check)

Thin CLI; the work is the draft kind's (drafts/registry.py: DraftKind.export and validate_export, the kind's
drafts/<kind>/export.py), which validates every tensor and writes nothing on any problem. The formats offered are
those the registered kinds write.

  specdistill-export --draft outputs/eagle3/checkpoints/step-0000100/draft --format vllm \
      --target embedded:smollm2-135m-instruct --out exported/eagle3-smollm2
  specdistill-export --draft <draft> --format sglang --target <target> --out <dir>   # SGLang's aux-id convention
  specdistill-export --draft <draft> --format speculators --target <target> --speculative-tokens 4 --out <dir>
  specdistill-export --check exported/eagle3-smollm2 [--target <target>]     # validate an existing export (any kind)

--out is the folder to create (refused if it exists, unless --overwrite). Serve the vllm export with
  LLM(model=<target>, speculative_config={"method": "eagle3", "model": <out>, "num_speculative_tokens": 4})
"""
import argparse
import sys
from pathlib import Path

from specdistill.files import WriteFailed, named_writes


def main(argv: list[str] | None = None) -> int:
    from specdistill.drafts import export_formats, exported_kind, saved_kind

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", help="trained draft folder (a checkpoint's draft/ folder)")
    p.add_argument("--out", help="export folder to create")
    p.add_argument("--format", default="vllm", choices=export_formats(),
                   help="the formats of the draft's kind. EAGLE-3: vllm = the midlayer format (default); sglang = the "
                        "same files with SGLang's aux layer ids (each id - 1: SGLang captures config id j after j + 1 "
                        "layers); speculators = vllm-project/speculators. DFlash: vllm")
    p.add_argument("--target", default=None,
                   help="the target the head serves with (HF folder or embedded:<name>): max_position_embeddings and "
                        "RoPE come from it and aux ids are range-checked against its depth (recommended)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: physical cores)")
    p.add_argument("--include-embeddings", action="store_true",
                   help="also write embed_tokens.weight (engines reuse the target's when absent)")
    p.add_argument("--speculative-tokens", type=int, default=3, help="speculators format: proposal length")
    p.add_argument("--verifier-name", default=None,
                   help="speculators format: verifier.name_or_path (default: the resolved --target path)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="cast float tensors (default: keep the checkpoint's)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--check", metavar="DIR", default=None, help="only validate an existing export folder")
    a = p.parse_args(argv)
    from specdistill.threads import configure_threads

    configure_threads(a.threads, "--threads")

    try:
        if a.check:
            kind = exported_kind(a.check)  # from its config.json's architectures
            res = kind.validate_export(a.check, target_path=a.target)
            print(res.summary())
            print(f"OK: {a.check} is a valid {res.format} {kind.name} export")
            return 0
        if not a.draft or not a.out:
            p.error("--draft and --out are required (or --check DIR)")
        with named_writes(Path(a.out).expanduser().parent, "--out", f"nothing was written; {a.draft} is untouched"):
            res = saved_kind(a.draft).spec.export(a.draft, a.out, fmt=a.format, target_path=a.target,  # its layout
                                                  include_embeddings=a.include_embeddings,
                                                  speculative_tokens=a.speculative_tokens,
                                                  verifier_name=a.verifier_name, overwrite=a.overwrite, dtype=a.dtype)
    except (ValueError, FileExistsError, FileNotFoundError, WriteFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(res.summary())
    print(f"OK: wrote {len(res.tensors)} tensors + config.json to {res.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
