"""The base model every config section derives from: unknown keys, NaN/inf and out-of-int64 integers refused."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator


class Strict(BaseModel):
    # NaN and infinity are refused everywhere (a NaN learning rate would train silently to garbage)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _int64(cls, v):
        if isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v < 2**63:
            raise ValueError(f"{v} is too large (at most 2^63 - 1)")
        return v
