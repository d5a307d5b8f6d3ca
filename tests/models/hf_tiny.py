"""Tiny random Hugging Face checkpoints, saved with ``save_pretrained`` (a few hundred KB
each, built in well under a second): one folder per architecture the ``hf-*`` kinds serve,
and two they refuse. Used by ``tests/models/test_hf_*.py`` and
``tests/integration/test_hf_folders.py``.

Every folder has what a real one has: ``config.json``, the weights (``model.safetensors``),
its tokenizer and/or ``preprocessor_config.json``. The tokenizer is a WordPiece one over a
small vocabulary (``VOCAB``), for the text towers of every architecture (a folder's
``tokenizer_config.json`` names the class, so ``AutoTokenizer`` loads it whatever the model).
"""

from __future__ import annotations

from pathlib import Path

import torch

_WORDS = "a an the of on in is at cat dog photo picture cup coffee rocket sky red blue green car"
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS.split(), "bird", "flower", "sat",
         "mat", "tabby", "espresso", "launch", "night", "day", "big", "small"]  # fmt: skip
ID2LABEL = {0: "tabby cat", 1: "espresso", 2: "space shuttle"}  # a ViT's own label names
SIDE = 32  # image side of every tiny vision tower (8-pixel patches: 16 of them)
_T = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
      "intermediate_size": 37}  # fmt: skip


def _tokenizer(tmp: Path) -> object:
    from transformers import BertTokenizerFast

    vocab = tmp / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    return BertTokenizerFast(vocab_file=str(vocab), model_max_length=48)


def _vit_processor() -> object:
    from transformers import ViTImageProcessor

    return ViTImageProcessor(size={"height": SIDE, "width": SIDE})


def _text_cfg(**extra: object) -> dict[str, object]:
    # 2,048 token embeddings (the tokenizer uses the first few): the text adapter traces
    # its encoder with random ids in 1000..1999.
    return {"vocab_size": 2048, "max_position_embeddings": 48, "pad_token_id": 0,
            "bos_token_id": 2, "eos_token_id": 3, **_T, **extra}  # fmt: skip


def _vision_cfg() -> dict[str, object]:
    return {"image_size": SIDE, "patch_size": 8, **_T}


def build(root: Path, kind: str) -> Path:
    """Save the tiny checkpoint ``kind`` under ``root/kind`` (seeded: the same weights every
    time) and return its folder.

    Kinds: ``bert`` (text encoder), ``vit-classifier`` (3 labels, :data:`ID2LABEL`),
    ``vit`` (vision ``AutoModel``), ``clip``, ``siglip``, ``dual`` (a
    ``VisionTextDualEncoderModel`` of a ViT and a BERT), ``gpt2`` and ``t5`` (refused).
    """
    import transformers as tf

    out = root / kind
    if out.exists():
        return out
    out.mkdir(parents=True)
    torch.manual_seed(0)
    tok = _tokenizer(root)
    if kind == "bert":
        model = tf.BertModel(tf.BertConfig(**_text_cfg()))
        procs = [tok]
    elif kind == "vit-classifier":
        label2id = {v: k for k, v in ID2LABEL.items()}
        cfg = tf.ViTConfig(**_vision_cfg(), num_labels=3, id2label=ID2LABEL, label2id=label2id)
        model = tf.ViTForImageClassification(cfg)
        procs = [_vit_processor()]
    elif kind == "vit":
        model = tf.ViTModel(tf.ViTConfig(**_vision_cfg()))
        procs = [_vit_processor()]
    elif kind == "clip":
        cfg = tf.CLIPConfig(text_config=_text_cfg(), vision_config=_vision_cfg(), projection_dim=16)
        model = tf.CLIPModel(cfg)
        procs = [tok, tf.CLIPImageProcessor(size={"shortest_edge": SIDE},
                                            crop_size={"height": SIDE, "width": SIDE})]  # fmt: skip
    elif kind == "siglip":
        text = _text_cfg(max_position_embeddings=16)
        model = tf.SiglipModel(tf.SiglipConfig(text_config=text, vision_config=_vision_cfg()))
        procs = [tok, tf.SiglipImageProcessor(size={"height": SIDE, "width": SIDE})]
    elif kind == "dual":
        cfg = tf.VisionTextDualEncoderConfig.from_vision_text_configs(
            tf.ViTConfig(**_vision_cfg()), tf.BertConfig(**_text_cfg()), projection_dim=16
        )
        model = tf.VisionTextDualEncoderModel(cfg)
        procs = [tok, _vit_processor()]
    elif kind == "gpt2":
        model = tf.GPT2Model(tf.GPT2Config(vocab_size=len(VOCAB), n_embd=32, n_layer=2, n_head=2))
        procs = [tok]
    elif kind == "t5":
        model = tf.T5Model(tf.T5Config(vocab_size=len(VOCAB), d_model=32, d_kv=16, d_ff=37,
                                       num_layers=2, num_heads=2))  # fmt: skip
        procs = [tok]
    else:
        raise ValueError(f"no tiny checkpoint {kind!r}")
    model.save_pretrained(out)
    for p in procs:
        p.save_pretrained(out)  # type: ignore[attr-defined]
    return out
