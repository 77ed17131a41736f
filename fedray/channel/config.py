"""``channel.*``: what happens to every message between clients and server (see :mod:`fedray.channel`).

Kept apart from :mod:`fedray.config` (which includes it as ``ExperimentConfig.channel``), as ``system.*`` is, so that
the channel's keys read in one place. The key names are a public contract: scripts and sweeps use them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fedray.errors import ConfigError

#: Keys that only mean something when a compression stage is on (``channel.quantize`` or ``channel.sparsify``).
COMPRESSION_KEYS = ("error_feedback", "compress_on")


class ChannelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    precision: Literal["fp32", "fp16", "bf16"] = Field(
        default="fp32", description="the floating-point format every message's floating tensors cross the wire in, "
        "both ways (integers and counts never change): fp32 sends them as they are; fp16 / bf16 cast each for the "
        "wire and back on arrival, halving their bytes (comm/bytes_*, the simulated transfer times)")
    quantize: Literal["none", "qsgd", "round"] = Field(
        default="none", description="qsgd: stochastic uniform quantisation at channel.bits bits an element, an L2 "
        "scale per channel.bucket elements, unbiased (QSGD); round: the same levels by deterministic rounding, "
        "biased")
    bits: int = Field(default=8, ge=1, le=16, description="quantize: bits an element, a sign bit included (s = "
                      "2^(bits-1) - 1 levels); 1: the scaled sign sign(v) ||v||_1 / d (qsgd only; biased)")
    bucket: int | None = Field(default=512, ge=1, description="quantize: elements sharing one scale; null: one scale "
                               "a tensor")
    sparsify: Literal["none", "topk", "randk"] = Field(
        default="none", description="topk: keep the channel.fraction of entries of largest magnitude; randk: a seeded "
        "random channel.fraction, scaled by d/k unless channel.error_feedback")
    fraction: float = Field(default=0.01, gt=0, le=1, description="sparsify: the fraction of each tensor's entries "
                            "sent (at least one)")
    error_feedback: bool = Field(default=False, description="keep what compression did not send and add it to the "
                                 "next message of the same tensor (uplink: per client, client state; downlink: server "
                                 "state)")
    compress_on: Literal["up", "down", "both"] = Field(
        default="up", description="which messages quantize / sparsify compress: uploads, payloads or both")

    @property
    def compresses(self) -> bool:
        return self.quantize != "none" or self.sparsify != "none"

    def check(self) -> None:
        """The keys' agreement with each other; ConfigError naming the key."""
        default = ChannelConfig()
        if self.quantize == "none":
            for key in ("bits", "bucket"):
                if getattr(self, key) != getattr(default, key):
                    raise ConfigError(f"channel.{key}", "is only read with channel.quantize=qsgd or round")
        if self.quantize == "round" and self.bits < 2:
            raise ConfigError("channel.bits", "deterministic rounding needs a sign bit and a level bit; allowed: "
                              "2..16 (bits=1, the scaled sign, is channel.quantize=qsgd's)")
        if self.sparsify == "none" and self.fraction != default.fraction:
            raise ConfigError("channel.fraction", "is only read with channel.sparsify=topk or randk")
        if not self.compresses:
            for key in COMPRESSION_KEYS:
                if getattr(self, key) != getattr(default, key):
                    raise ConfigError(f"channel.{key}", "needs compression; set channel.quantize or channel.sparsify")
