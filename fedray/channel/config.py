"""``channel.*``: what happens to every message between clients and server (see :mod:`fedray.channel`).

Kept apart from :mod:`fedray.config` (which includes it as ``ExperimentConfig.channel``), as ``system.*`` is, so that
the channel's keys read in one place. The key names are a public contract: scripts and sweeps use them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ChannelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    precision: Literal["fp32", "fp16", "bf16"] = Field(
        default="fp32", description="the floating-point format every message's floating tensors cross the wire in, "
        "both ways (integers and counts never change): fp32 sends them as they are; fp16 / bf16 cast each for the "
        "wire and back on arrival, halving their bytes (comm/bytes_*, the simulated transfer times)")
