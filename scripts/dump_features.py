"""Write the target's features for the training data once (offline mode), then train from them.

  python scripts/dump_features.py recipe=eagle3 data.offline_dir=/data/feats/smollm2_sharegpt
  python train.py recipe=eagle3 data.offline_dir=/data/feats/smollm2_sharegpt

Same Hydra groups as train.py, so the data is tokenized exactly as training will see it. Stores, per token, the aux
hidden states of the EAGLE-3 layers and the target's final hidden state (bf16; logits are rebuilt from it with the
target's lm_head at train time). The size is estimated and shown first, and refused if the disk cannot hold it; the
writer keeps at most one shard in memory (data/features.py).
"""
import shutil
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from specdistill.config import CONF_DIR, Config, register_configs


def dump(cfg: Config, batch_size: int = 4, shard_mb: int = 256) -> Path:
    import torch
    from tqdm.auto import tqdm

    from specdistill.build import build_target, build_tokenizer, feature_meta
    from specdistill.data.chat import collate
    from specdistill.data.dataset import build_data
    from specdistill.data.features import FeatureWriter, estimate_bytes
    from specdistill.drafts.eagle3.model import default_aux_layer_ids

    if not cfg.data.offline_dir:
        raise ValueError("set data.offline_dir=<folder to write the features into>")
    target = build_target(cfg.target)
    L = target.config.num_hidden_layers
    target.set_aux_layer_ids(list(cfg.target.aux_layer_ids or default_aux_layer_ids(L)))
    tok = build_tokenizer(cfg)
    data = build_data(cfg.data, tok)
    H = target.config.hidden_size
    A = H * len(target.aux_layer_ids)
    n_tokens = sum(len(x) for x in data.train["input_ids"])
    need = estimate_bytes(n_tokens, A, H)
    out = Path(cfg.data.offline_dir).expanduser()
    free = shutil.disk_usage(out.parent if out.parent.exists() else Path.cwd()).free
    print(f"[features] {len(data.train)} examples, {n_tokens:,} tokens x ({A} aux + {H} final) bf16 = "
          f"{need / 2**30:.2f} GiB -> {out} ({free / 2**30:.1f} GiB free)")
    if need > 0.9 * free:
        raise OSError(f"not enough disk for {need / 2**30:.2f} GiB of features in {out.parent}: free space first, "
                      "lower data.max_rows / data.max_length, or train online (data.offline_dir=null)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target.to(device)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = FeatureWriter(out, feature_meta(cfg.target, target.aux_layer_ids, data), shard_mb=shard_mb)
    pad = tok.pad_token_id
    for s in tqdm(range(0, len(data.train), batch_size), desc="target features", unit="batch"):
        rows = [data.train[i] for i in range(s, min(s + batch_size, len(data.train)))]
        b = collate(rows, pad)
        with torch.no_grad():
            o = target.model(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device),
                             output_hidden_states=True, use_cache=False, logits_to_keep=1)
        aux = torch.cat([o.hidden_states[k] for k in target.aux_layer_ids], dim=-1)  # (B, T, A)
        final = o.hidden_states[-1]  # (B, T, H): after the final norm in HF decoders, what lm_head reads
        for r, row in enumerate(rows):
            n = len(row["input_ids"])
            writer.add(aux[r, :n], final[r, :n])
    path = writer.close()
    print(f"[features] wrote {path}")
    return path


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(composed: DictConfig) -> None:
    from specdistill.threads import configure_threads
    from specdistill.entry import load_config

    cfg = load_config(composed)  # checked and typed once: before any model loads
    configure_threads(cfg.trainer.threads, "trainer.threads")
    dump(cfg)


if __name__ == "__main__":
    register_configs()
    sys.argv.append("hydra.run.dir=.")
    main()
