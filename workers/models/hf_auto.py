"""Kind ``hf``: a Hugging Face folder whose ``config.json`` picks the adapter at load.

``[models.<name>] kind = "hf"`` with ``checkpoint = "/path"``: at load the folder is read
(:func:`workers.models.hf_folder.inspect_folder`) and served by the adapter of its family
(``hf-text``, ``hf-image`` or ``hf-xmodal``), with the table's keys that kind has (the
``hf`` table accepts every ``hf-*`` key; each adapter reads its own). The folder's family
must serve the modality that names the model: a CLIP folder on the text modality is
refused (``MODEL_UNSUPPORTED``), as is a folder no adapter serves. Every adapter call after
``load`` goes to the chosen adapter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shared.model_kinds import HF_KEYS, HFOptions
from workers.models.base import ModelAdapter, Prepared, require_loaded
from workers.models.hf_folder import FAMILY_KIND, UnsupportedFolder, inspect_folder
from workers.models.image import _model_name

if TYPE_CHECKING:
    from shared.settings import Settings
    from workers.models.runtime import DeviceRuntime


def serving_modalities(settings: Settings, name: str) -> list[str]:
    """The modalities whose ``model`` is ``name``."""
    return [m for m, cfg in settings.modalities.items() if cfg.model == name]


class HFAutoAdapter(ModelAdapter):
    """The ``hf-*`` adapter the folder's config picks (see the module docstring)."""

    options_type = HFOptions

    def __init__(self, cfg: HFOptions, settings: Settings, runtime: DeviceRuntime) -> None:
        super().__init__(cfg, settings, runtime)
        self.cfg: HFOptions = cfg
        self.name = _model_name(cfg, settings)
        self.inner: ModelAdapter | None = None

    def load(self) -> None:
        """Pick the adapter from the folder's config, build it with this table's keys, load.

        Raises:
            UnsupportedFolder: no adapter serves the folder, or not on the modality that
                names this model.
            ModelTooLarge, ModelError: from the chosen adapter's ``load``.
        """
        from workers.models import adapter_class

        folder = inspect_folder(self.cfg.checkpoint, self.name)
        served = serving_modalities(self.settings, self.name)
        if served and folder.modality not in served:
            raise UnsupportedFolder(
                f"model {self.name!r}: {str(folder.path)!r} holds {folder.found}, served on "
                f"the {folder.modality} modality; this model is named by {', '.join(served)}"
            )
        kind = FAMILY_KIND[folder.family]
        options = HF_KEYS[kind]
        keys = {k: getattr(self.cfg, k) for k in options.model_fields if k != "kind"}
        cfg = options(kind=kind, **keys)
        inner = adapter_class(kind)(cfg, self.settings, self.runtime)
        inner.name = self.name  # type: ignore[attr-defined]  # messages name the table
        inner.load()
        self.inner = inner
        self.modality = inner.modality
        self.tensor_inputs = inner.tensor_inputs  # type: ignore[misc]

    def _inner(self) -> ModelAdapter:
        return require_loaded(self.inner, self.name)  # type: ignore[no-any-return]

    def prepare(self, inputs: dict[str, Any]) -> Prepared:
        return self._inner().prepare(inputs)

    def preprocess(self, prepared: Prepared) -> Any:
        return self._inner().preprocess(prepared)

    def run_batch(self, samples: list[Any]) -> list[dict[str, Any]]:
        return self._inner().run_batch(samples)

    def example_inputs(self, batch_size: int, bucket: str | None = None) -> list[dict[str, Any]]:
        return self._inner().example_inputs(batch_size, bucket)

    def buckets(self) -> list[str]:
        return self._inner().buckets()

    def torch_modules(self) -> list[Any]:
        return [] if self.inner is None else self.inner.torch_modules()

    def describe(self) -> dict[str, Any]:
        if self.inner is None:
            return {"kind": self.cfg.kind, "name": self.name, "weights": self.cfg.checkpoint}
        return {**self.inner.describe(), "kind": f"hf -> {self.inner.cfg.kind}"}
