"""Rotary position embeddings as Hugging Face computes them: inverse frequencies (plain, Llama 3's
banded scaling, linear interpolation, YaRN) and the "rotate_half" pairing (dimension ``d`` with
``d + Dh/2``), so a checkpoint's weights convert without any permutation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "llama3", "linear", "yarn")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
YARN_KEYS = ("factor", "original_max_position_embeddings")
YARN_OPTIONS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                "truncate")


def normalize_scaling(scaling, max_positions: int, owner: str):
    """``rope_scaling`` as a hashable sorted tuple of items including ``rope_type`` (None for
    plain RoPE); unsupported types and missing keys are refused by name."""
    if scaling is None or isinstance(scaling, tuple):
        return scaling
    if not isinstance(scaling, dict):
        raise ValueError(f"{owner}.rope_scaling={scaling!r} must be None or a dict")
    scaling = dict(scaling)
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    scaling.pop("rope_theta", None)
    if kind == "default":
        return None
    if kind == "llama3":
        scaling.setdefault("original_max_position_embeddings", max_positions)
        keys = LLAMA3_KEYS
    elif kind == "linear":
        keys = ("factor",)
    elif kind == "yarn":
        scaling = {k: v for k, v in scaling.items() if v is not None}
        scaling.setdefault("original_max_position_embeddings", max_positions)
        keys = (*YARN_KEYS, *(k for k in YARN_OPTIONS if scaling.get(k) is not None))
    else:
        raise ValueError(f"{owner}.rope_scaling type {kind!r} is not supported; "
                         f"supported: {ROPE_TYPES}")
    missing = [k for k in keys if scaling.get(k) is None]
    if missing:
        raise ValueError(f"{owner}.rope_scaling ({kind}) lacks {missing}")
    extra = sorted(set(scaling) - set(keys) - {"partial_rotary_factor"})
    if extra or scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{owner}.rope_scaling ({kind}) sets {extra or 'partial_rotary_factor'}"
                         ", which fiddlejax does not implement")
    return (("rope_type", kind), *sorted((k, scaling[k]) for k in keys))


def scaling_dict(scaling) -> dict | None:
    """A normalized ``rope_scaling`` back as Hugging Face writes it."""
    return None if scaling is None else dict(scaling)


def inverse_frequencies(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    """Inverse frequencies ``[head_dim / 2]`` (float32, as transformers computes them)."""
    inv = (1.0 / (np.float32(theta)
                  ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))))
    inv = inv.astype(np.float32)
    if scaling is None:
        return inv
    s = dict(scaling)
    if s["rope_type"] == "linear":
        return (inv / np.float32(s["factor"])).astype(np.float32)
    if s["rope_type"] == "yarn":
        return _yarn(inv, head_dim, theta, s)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    # Long wavelengths (beyond the original context / low) are slowed by `factor`, short ones
    # (below old / high) kept, and the band between them interpolated smoothly.
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(inv: np.ndarray, dim: int, theta: float, s: dict) -> np.ndarray:
    """YaRN: the slow dimensions interpolated by ``factor``, the fast ones kept, a linear ramp
    between the correction range of ``beta_fast`` and ``beta_slow`` rotations (transformers'
    ``_compute_yarn_parameters``)."""
    factor, old = s["factor"], s["original_max_position_embeddings"]
    corr = lambda rot: dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(theta))
    low, high = corr(s.get("beta_fast", 32)), corr(s.get("beta_slow", 1))
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)
    pos = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    interp = (1.0 / (np.float32(factor) * pos.astype(np.float32))).astype(np.float32)
    return (interp * (1 - keep) + inv * keep).astype(np.float32)


def mscale(factor: float, scale: float = 1.0) -> float:
    """YaRN's magnitude scale ``0.1 * scale * ln(factor) + 1`` (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def yarn_factors(scaling) -> tuple[float, float]:
    """``(cos/sin factor, softmax factor)`` of a normalized ``rope_scaling``: YaRN's
    ``attention_factor`` (default ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``,
    or ``mscale(factor)``) and DeepSeek's ``mscale(factor, mscale_all_dim) ** 2`` on the
    softmax scale; ``(1, 1)`` for other types."""
    s = dict(scaling or ())
    if s.get("rope_type") != "yarn":
        return 1.0, 1.0
    f, m, m_all = s["factor"], s.get("mscale"), s.get("mscale_all_dim")
    att = s.get("attention_factor")
    if att is None:
        att = mscale(f, m) / mscale(f, m_all) if m and m_all else mscale(f)
    return float(att), (mscale(f, m_all) ** 2 if m_all else 1.0)


def apply_rope(x: jax.Array, inv_freq: np.ndarray, positions: jax.Array | None = None
               ) -> jax.Array:
    """Rotary embedding of ``x[B, T, H, Dh]`` at positions ``0 .. T-1`` (rotate_half pairing),
    or at ``positions[B, T]`` (packed documents, a KV cache's offset)."""
    if positions is None:
        pos = jnp.arange(x.shape[1], dtype=jnp.float32)
        freqs = pos[:, None] * jnp.asarray(inv_freq)[None, :]
        emb = jnp.concatenate([freqs, freqs], axis=-1)[None, :, None, :]
    else:
        freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
        emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
