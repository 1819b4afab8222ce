"""Where the object-store tier's bucket is (vLLM 0.33: ``ObjStoreConfig`` in
``vllm/v1/kv_offload/tiering/obj/config.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

_OPTIONAL = ("access_key", "secret_key", "session_token", "region", "ca_bundle")


@dataclass
class ObjStoreConfig:
    """An S3-compatible bucket as NIXL's OBJ plugin takes it.

    Leave ``access_key`` and ``secret_key`` empty to let the plugin's AWS SDK find
    credentials itself (an IAM role, environment variables, a credentials file): an empty
    field is left out of the plugin's parameters rather than sent as ``""``, which would
    override that chain. The secrets are kept out of ``repr``.
    """

    bucket: str
    endpoint_override: str
    access_key: str = field(default="", repr=False)
    secret_key: str = field(default="", repr=False)
    session_token: str = field(default="", repr=False)
    region: str = ""
    scheme: str = "http"
    ca_bundle: str = ""

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def to_nixl_params(self) -> dict[str, str]:
        """The OBJ backend's parameters: bucket, endpoint and scheme always, the rest only
        when set."""
        params = {"bucket": self.bucket, "endpoint_override": self.endpoint_override, "scheme": self.scheme}
        params.update({name: getattr(self, name) for name in _OPTIONAL if getattr(self, name)})
        return params
