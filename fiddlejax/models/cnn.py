"""A small ReLU / max-pool convolutional classifier (the model Gist's encodings are measured on).

Stage declaration: ``prologue`` is a 3x3 stem convolution; ``blocks`` are identical residual
layers ``x + conv(relu(conv(relu(x))))``; ``head`` is ReLU + 2x2 max-pool (Gist's Binarize
pattern), global average pooling and a dense classifier; ``loss`` is softmax cross-entropy.
Activations go through ``fiddlejax.memory.gist`` so a plan's ``encodings=[...]`` change what is
stashed for the backward without touching this file: the layout offers them as
``ops.encodings`` to the stem, the blocks and the head, which pass them on.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from fiddlejax.memory import gist
from fiddlejax.parallel.ops import Ops

from .common import annotated, param, scan_layers, stacked


def _encodings(ops: Ops | None) -> gist.Encodings | None:
    return None if ops is None else ops.encodings


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    image_size: int = 8
    in_channels: int = 1
    channels: int = 32
    n_layers: int = 4
    num_classes: int = 10


def _conv_init(fan_in_scale: float = 2.0):
    return jax.nn.initializers.variance_scaling(fan_in_scale, "fan_in", "truncated_normal")


class ConvBlock(nnx.Module):
    def __init__(self, channels: int, n_layers: int, *, rngs: nnx.Rngs):
        axes = (None, None, "channels", "channels")
        self.k1 = param(rngs, _conv_init(), (3, 3, channels, channels), axes)
        self.b1 = annotated(jnp.zeros((channels,)), ("channels",))
        self.k2 = param(rngs, _conv_init(2.0 / n_layers), (3, 3, channels, channels), axes)
        self.b2 = annotated(jnp.zeros((channels,)), ("channels",))

    def __call__(self, x: jax.Array, ops: Ops | None = None) -> jax.Array:
        enc = _encodings(ops)
        h = gist.conv(gist.relu(x, enc), self.k1[...], self.b1[...], relu_input=True,
                      encodings=enc)
        return x + gist.conv(gist.relu(h, enc), self.k2[...], self.b2[...], relu_input=True,
                             encodings=enc)


class CNN(nnx.Module):
    stack = "blocks"

    def __init__(self, config: CNNConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        self.stem = param(rngs, _conv_init(1.0), (3, 3, c.in_channels, c.channels),
                          (None, None, None, "channels"))
        self.blocks = stacked(c.n_layers, lambda r: ConvBlock(c.channels, c.n_layers, rngs=r),
                              rngs)
        self.fc = param(rngs, _conv_init(1.0), (c.channels, c.num_classes),
                        ("channels", "classes"))
        self.fc_bias = annotated(jnp.zeros((c.num_classes,)), ("classes",))

    def prologue(self, batch: dict, ops: Ops | None = None) -> jax.Array:
        return gist.conv(batch["images"], self.stem[...], encodings=_encodings(ops))

    def head(self, x: jax.Array, ops: Ops | None = None) -> jax.Array:
        pooled = gist.relu_maxpool(x, (2, 2), encodings=_encodings(ops)).mean(axis=(1, 2))
        return pooled @ self.fc[...] + self.fc_bias[...]

    def loss(self, logits: jax.Array, batch: dict) -> jax.Array:
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.take_along_axis(logp, batch["labels"][:, None], axis=1).mean()

    def batch_spec(self, batch_size: int) -> dict:
        c = self.config
        return {
            "images": jax.ShapeDtypeStruct(
                (batch_size, c.image_size, c.image_size, c.in_channels), jnp.float32),
            "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        }

    def __call__(self, images: jax.Array) -> jax.Array:
        return self.head(scan_layers(self.blocks, self.prologue({"images": images})))


# -- what the fiddlejax train job needs (models.REGISTRY["cnn"]) ------------------------------
def flops_per_step(config: CNNConfig, batch_size: int) -> float:
    """Training FLOPs of one step: two 3x3 convolutions per layer, forward + backward (3x)."""
    c, hw = config.channels, config.image_size ** 2
    per_example = config.n_layers * 2 * (2 * 9 * c * c * hw)
    return 3.0 * per_example * batch_size


def correct(model: CNN, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(examples classified right, examples) of a batch: the job's validation accuracy."""
    hits = jnp.argmax(model(batch["images"]), axis=-1) == batch["labels"]
    return hits.sum(), jnp.asarray(hits.size)


def digit_batches(cfg: dict, process_index: int, process_count: int):
    """The job's train and validation streams: 8x8 digits, ``{"images", "labels"}``."""
    from fiddlejax import data

    from .feed import Batches

    b, seed = cfg["data"]["batch_size"], cfg["data"]["seed"]
    shard = {"process_index": process_index, "process_count": process_count}
    train = data.image_batches(*data.digits("train"), b, seed=seed, **shard)
    val = data.image_batches(*data.digits("validation"), b, shuffle=False, repeat=True, **shard)
    return Batches(iter(train), iter(val), b, unit="examples")
