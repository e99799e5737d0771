"""``model.name``: the bundled models, the Hugging Face decoder families and ``auto``.

``auto`` (the default) is GPT, or with ``model.from_pretrained=DIR`` the family its
``config.json`` names (``model_type``), so fine-tuning a Hugging Face directory needs no
``model.name``. Resolved when the config loads, so the run's saved ``config.yaml`` names the
family and ``fiddlejax export`` / ``eval`` rebuild the same model.
"""

from __future__ import annotations

import json
from pathlib import Path

# Hugging Face model_type values the shared decoder reads: the one list of the families every
# other place reads (fiddlejax.models.families.SUPPORTED are those its generic reader reads;
# DeepSeek-V3 and GPT-OSS have their own: fiddlejax.models.deepseek_config, gpt_oss_config).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text",
            "mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
MOES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")  # mixtures of experts
# model.* keys a family's config takes beside its config.json (models.from_pretrained's
# overrides), e.g. DeepSeek-V3's loss-free balancing speed.
OVERRIDES = ("bias_update_speed",)
DECODERS = ("gpt", *FAMILIES)  # the next-token models: own data, generate, export
NAMES = ("auto", "gpt", "bert", "cnn", *FAMILIES)


def resolve(model: dict) -> None:
    """Replace ``model.name=auto`` by the model it means (in place); ``ValueError`` naming the
    key and the file when ``model.from_pretrained``'s family cannot be read or is unknown.
    A hub id in ``model.from_pretrained`` becomes its snapshot's directory in the local cache
    (:mod:`fiddlejax.models.hub`; FileNotFoundError when it is not there)."""
    if model.get("from_pretrained"):
        from fiddlejax.models import hub

        model["from_pretrained"] = str(hub.local_dir(model["from_pretrained"]))
    if model.get("name") != "auto":
        return
    src = model.get("from_pretrained")
    if not src:
        model["name"] = "gpt"
        return
    path = Path(src) / "config.json"
    try:
        family = json.loads(path.read_text()).get("model_type", "llama")
    except FileNotFoundError:
        raise ValueError(f"model.from_pretrained={src} has no config.json; pass a Hugging Face "
                         "model directory (config.json + *.safetensors)") from None
    except (ValueError, AttributeError) as e:  # cut off, not UTF-8, not a JSON object
        raise ValueError(f"model.from_pretrained={src}: config.json is damaged ({e}); restore "
                         "or re-download it") from None
    except OSError as e:
        raise ValueError(f"model.from_pretrained={src}: cannot read {path} ({e.strerror or e})"
                         ) from None
    if family not in FAMILIES:
        raise ValueError(f"model.from_pretrained={src} holds model_type={family!r}, which "
                         f"fiddlejax does not implement; supported: {', '.join(FAMILIES)}")
    model["name"] = family
