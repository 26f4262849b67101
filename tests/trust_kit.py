"""Key pairs and a trust file for tests (not a test module).

``TrustKit(tmp_path).add("payments", Role.PARTICIPANT)`` writes a key file and the
trust entry; :meth:`TrustKit.settings` gives settings that sign as that identity.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from schemas.models import Record
from schemas.settings import Settings
from schemas.signing import (
    ALG_HEADER,
    KID_HEADER,
    SIG_HEADER,
    Headers,
    Signer,
    signed_material,
)
from schemas.trust import IdentitySigner, Role, TrustStore, load_private_key, new_key_pair
from schemas.wire import to_message


class TrustKit:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.trust_file = directory / "trust.json"
        self.data: dict[str, Any] = {"identities": {}, "keys": {}}
        self.key_files: dict[str, Path] = {}  # key id -> PEM file
        self.current: dict[str, str] = {}  # identity -> newest key id
        self._write()

    def add(
        self,
        identity: str,
        role: Role,
        *,
        tenants: list[str] | None = None,
        principals: list[str] | None = None,
        acts_for: list[str] | None = None,
    ) -> str:
        """A new key for ``identity`` (created with ``role`` on first use); its key id."""
        pem, kid, entry = new_key_pair(identity, role)
        ident = self.data["identities"].setdefault(identity, entry["identities"][identity])
        if tenants is not None:
            ident["tenants"] = tenants
        if principals is not None:
            ident["principals"] = principals
        if acts_for is not None:
            ident["acts_for"] = acts_for
        self.data["keys"].update(entry["keys"])
        path = self.dir / f"{kid}.pem"
        path.write_bytes(pem)
        self.key_files[kid] = path
        self.current[identity] = kid
        self._write()
        return kid

    def retire(self, key_id: str) -> None:
        self.data["keys"][key_id]["retired"] = True
        self._write()

    def signer(self, identity: str | None = None, key_id: str | None = None) -> IdentitySigner:
        kid = key_id or (self.current[identity] if identity else None)
        private = load_private_key(self.key_files[kid]) if kid else None
        return IdentitySigner(TrustStore.load(self.trust_file), private, kid)

    def forged(self, record: Record, key_id: str) -> tuple[bytes, bytes, Headers]:
        """``record`` signed with key ``key_id`` as someone holding the key file would,
        even a retired key (the process's own signer refuses to use one)."""
        key, value, _ = to_message(record, Signer(None))
        return key, value, self.signed_headers(key, value, key_id)

    def signed_headers(self, key: bytes, value: bytes, key_id: str) -> Headers:
        """Identity-signature headers for raw ``(key, value)`` under key ``key_id``."""
        signature = load_private_key(self.key_files[key_id]).sign(signed_material(key, value))
        return [
            (SIG_HEADER, signature.hex().encode("ascii")),
            (KID_HEADER, key_id.encode("utf-8")),
            (ALG_HEADER, b"ed25519"),
        ]

    def settings(self, base: Settings, identity: str | None, key_id: str | None = None) -> Settings:
        kid = key_id or (self.current[identity] if identity else None)
        return dataclasses.replace(
            base,
            hmac_key=None,
            trust_file=self.trust_file,
            signing_key=self.key_files[kid] if kid else None,
            signing_key_id=kid,
        )

    def _write(self) -> None:
        # Write-then-rename: a reader never sees half a file.
        tmp = self.trust_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        tmp.replace(self.trust_file)
