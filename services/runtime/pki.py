"""Throwaway certificate authorities and certificates, for tests and local TLS trials.

    python -m services.runtime.pki DIR [NAME ...]

writes `ca.pem`, and for each NAME (default `localhost`) `NAME.pem` and `NAME-key.pem`
valid for that name, `localhost` and 127.0.0.1, usable as server and client certificates
(the common name is NAME: on internal ports with mutual TLS it names the caller, e.g. `engine`).

Never use these in production: the CA key is thrown away and the certificates last a day.
Needs the `cryptography` package (a development dependency).
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Authority", "IssuedCert"]


@dataclasses.dataclass(frozen=True)
class IssuedCert:
    """Files of one issued certificate."""

    cert_file: Path
    key_file: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class Authority:
    """A certificate authority whose certificate is written to `folder/ca.pem`.

    Args:
        folder: where the files go (created).
        name: the CA's common name.
    """

    def __init__(self, folder: Path, name: str = "system test CA") -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.ca_file = self.folder / "ca.pem"
        self.ca_file.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, common_name: str, *, file_stem: str | None = None) -> IssuedCert:
        """A certificate for `common_name` (also valid for localhost and 127.0.0.1), for
        servers and clients alike. Rewrites the files if they exist (a renewal)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        names: list[x509.GeneralName] = [
            x509.DNSName(common_name),
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        stem = file_stem or common_name
        issued = IssuedCert(self.folder / f"{stem}.pem", self.folder / f"{stem}-key.pem")
        # Key first, then the certificate: a reader that sees the new certificate finds its key.
        issued.key_file.write_bytes(_pem_key(key))
        issued.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return issued


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    authority = Authority(Path(argv[0]))
    for name in argv[1:] or ["localhost"]:
        issued = authority.issue(name)
        print(f"{name}: {issued.cert_file} {issued.key_file}")
    print(f"CA: {authority.ca_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
