"""Text embeddings from any Hugging Face encoder folder (kind ``hf-text``).

The folder: an encoder ``AutoModel`` saved with ``save_pretrained`` plus its tokenizer (BGE,
E5, GTE, any sentence-transformers BERT/RoBERTa/XLM-R/MPNet model's files; see
:mod:`workers.models.hf_folder` for what is refused). Request and result as the text
modality's default model (``{"text": str}`` -> ``{"embedding", "dim", "tokens",
"truncated"}``) plus ``"model"``.

The machinery is the text modality's own (:class:`workers.models.text.TextAdapter`, run with
this folder): the same input checks, tokenisation, truncation to ``max_length`` (keeping the
final special token), length buckets (``[modalities.text.batching] length_buckets``), traced
encoder and trace cache (keyed by the folder's files). What this adapter adds is the pooling
of the encoder's last hidden state:

- ``mean``: the mean over the attention mask (sentence-transformers' mean pooling: BGE-M3
  dense excepted, MiniLM, E5, GTE);
- ``cls``: the first token's state (BGE);
- ``last``: the last non-padding token's state (texts are padded on the right);

then, with ``normalize`` (default), L2 normalisation. ``max_length`` 0 (default) takes the
model's: the smaller of the tokenizer's ``model_max_length`` and the config's
``max_position_embeddings``. Instruction prefixes ("query: ", "passage: ") are the
caller's to write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shared.errors import ModelError
from shared.model_kinds import HFTextOptions, TextOptions
from workers.models.base import ModelAdapter, Prepared, require_loaded
from workers.models.hf_folder import HFFolder, inspect_folder, require_family
from workers.models.hf_partition import check_runtime_fits
from workers.models.image import _model_name
from workers.models.precision import parse_precision
from workers.models.text import TextAdapter

if TYPE_CHECKING:
    from shared.settings import Settings
    from workers.models.runtime import DeviceRuntime

_HUGE = 1_000_000  # a tokenizer's model_max_length above this means "not set"


def model_max_length(folder: HFFolder, tokenizer: Any) -> int:
    """The longest input the model takes: min(tokenizer's ``model_max_length``, config's
    ``max_position_embeddings``), whichever are set.

    Raises:
        ModelError: neither is set.
    """
    found = []
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < _HUGE:
        found.append(tok_max)
    pos = folder.config.get("max_position_embeddings")
    if isinstance(pos, int) and pos > 0:
        found.append(pos)
    if not found:
        raise ModelError(
            f"{str(folder.path)!r}: neither the tokenizer's model_max_length nor the config's "
            "max_position_embeddings is set; set max_length in the model's table"
        )
    return min(found)


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """``(B, T, H)`` states and their ``(B, T)`` mask (right-padded) -> ``(B, H)``."""
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        last = mask.sum(1).clamp(min=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


class HFTextAdapter(ModelAdapter):
    """Embeddings of a Hugging Face text encoder folder (see the module docstring)."""

    modality = "text"
    tensor_inputs = False
    options_type = HFTextOptions

    def __init__(self, cfg: HFTextOptions, settings: Settings, runtime: DeviceRuntime) -> None:
        super().__init__(cfg, settings, runtime)
        self.cfg: HFTextOptions = cfg
        self.name = _model_name(cfg, settings)
        self.text: TextAdapter | None = None
        self.folder: HFFolder | None = None
        self.weight_bytes = 0

    def load(self) -> None:
        """Check the folder (an encoder, fits the partition), then load it with the text
        modality's adapter (tokenizer, trace cache, eager model).

        Raises:
            UnsupportedFolder: not a text encoder folder (``MODEL_UNSUPPORTED``).
            ModelTooLarge: its weights exceed the partition (``MODEL_TOO_LARGE``).
            ModelError: ``max_length`` above the model's, or transformers cannot load it.
        """
        from transformers import AutoTokenizer

        folder = inspect_folder(self.cfg.checkpoint, self.name)
        require_family(folder, self.name, ("text",), self.cfg.kind)
        precision = parse_precision(self.cfg.precision, self.runtime.device)
        self.weight_bytes = check_runtime_fits(self.name, folder.path, precision, self.runtime)
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder.path, local_files_only=True)
        except Exception as e:
            raise ModelError(f"model {self.name!r}: cannot load its tokenizer: {e}") from e
        limit = model_max_length(folder, tokenizer)
        max_length = self.cfg.max_length or limit
        if max_length > limit or max_length < 3:
            raise ModelError(
                f"model {self.name!r}: max_length {max_length} outside 3..{limit} (the model's)"
            )
        opts = TextOptions(
            kind="minilm",
            checkpoint=str(folder.path),
            max_length=max_length,
            torchscript=self.cfg.torchscript,
            precision=precision,  # type: ignore[arg-type]
        )
        text = TextAdapter(opts, self.settings, self.runtime)
        try:
            text.load()
        except Exception as e:
            raise ModelError(f"model {self.name!r}: cannot load {str(folder.path)!r}: {e}") from e
        text.name = self.name
        self.folder, self.text = folder, text

    def _text(self) -> TextAdapter:
        return require_loaded(self.text, self.name)  # type: ignore[no-any-return]

    def torch_modules(self) -> list[Any]:
        return [] if self.text is None else self.text.torch_modules()

    def prepare(self, inputs: dict[str, Any]) -> Prepared:
        """The text modality's checks, tokenisation and bucket (``TextAdapter.prepare``)."""
        return self._text().prepare(inputs)

    def run_batch(self, samples: list[Any]) -> list[dict[str, Any]]:
        """Encode a batch padded to its longest text; pool; normalise if configured."""
        text = self._text()
        if not samples:
            return []
        width = max(len(ids) for ids, _ in samples)
        ids_t = torch.full((len(samples), width), text.pad_id, dtype=torch.long)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        for i, (ids, _) in enumerate(samples):
            ids_t[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[i, : len(ids)] = 1
        ids_t, mask = self.runtime.stage([ids_t, mask])
        with torch.inference_mode():
            if text.traced is not None:
                hidden = text.traced(ids_t, mask)
            else:
                hidden = text.model(input_ids=ids_t, attention_mask=mask).last_hidden_state
            pooled = pool(hidden, mask, self.cfg.pooling).float()
            if self.cfg.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        rows = pooled.cpu().tolist()
        return [
            {"embedding": row, "dim": len(row), "tokens": len(ids), "truncated": tr,
             "model": self.name}
            for row, (ids, tr) in zip(rows, samples, strict=True)
        ]  # fmt: skip

    def buckets(self) -> list[str]:
        return self._text().buckets()

    def example_inputs(self, batch_size: int, bucket: str | None = None) -> list[dict[str, Any]]:
        return self._text().example_inputs(batch_size, bucket)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        text = self.text
        out.update(
            name=self.name,
            weights=self.cfg.checkpoint,
            model_type=None if self.folder is None else self.folder.model_type,
            architectures=None if self.folder is None else list(self.folder.architectures),
            dim=None if text is None else text.dim,
            max_length=None if text is None else text.max_length,
            pooling=self.cfg.pooling,
            normalize=self.cfg.normalize,
            precision=None if text is None else text.precision,
            torchscript=text is not None and text.traced is not None,
            trace_cache=None if text is None else text.trace_cache,
            weight_bytes=self.weight_bytes,
        )
        return out
