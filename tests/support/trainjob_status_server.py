"""A Kubeflow Trainer status server on loopback, over HTTPS with a CA made for the test, as strict as the API.

It takes what kubeflow/trainer's pkg/statusserver takes: a POST to the TrainJob's path with ``Authorization:
Bearer <token>`` and a JSON ``UpdateTrainJobStatusRequest``, checked here against kubeflow-trainer-api's models
(stricter than the controller's Go decoder: an unknown field is refused too) and the TrainJob CRD's limits
(progressPercentage 0-100, at most 256 metrics, names and values of 1 to 64 characters, lastUpdatedTime
required). Every request that breaks a rule, and any error of the server itself, is kept in ``problems``; the
fixture that starts it fails the test on any.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import ssl
import threading
import traceback
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kubeflow_trainer_api.models import (
    TrainerV1alpha1Metric,
    TrainerV1alpha1TrainerStatus,
    TrainerV1alpha1UpdateTrainJobStatusRequest,
)
from pydantic import BaseModel, ValidationError

NAMESPACE, TRAINJOB = "team-a", "resnet"
PATH = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NAMESPACE}/trainjobs/{TRAINJOB}/status"
TOKEN = "eyJhbGciOiJSUzI1NiJ9.projected-token.signature"
# metav1.Time's encoding, RFC 3339.
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")
HOLD_AT_MOST_S = 60.0  # a held request is let go by then, whatever the test does


def _fields(model: type[BaseModel]) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


def request_problems(body: Any) -> list[str]:
    """What is wrong with a request body, by the API's models and the CRD's limits; [] if nothing."""
    if not isinstance(body, dict):
        return [f"the body is a {type(body).__name__}, not an object"]
    problems = [f"unknown field {name!r}" for name in set(body) - _fields(TrainerV1alpha1UpdateTrainJobStatusRequest)]
    status = body.get("trainerStatus")
    if not isinstance(status, dict):
        return [*problems, "no trainerStatus object"]
    problems += [f"unknown field trainerStatus.{name}" for name in set(status) - _fields(TrainerV1alpha1TrainerStatus)]
    metrics = status.get("metrics", [])
    for metric in metrics if isinstance(metrics, list) else []:
        unknown = set(metric) - _fields(TrainerV1alpha1Metric) if isinstance(metric, dict) else set()
        problems += [f"unknown field in metric {metric}: {name!r}" for name in unknown]
    try:
        TrainerV1alpha1UpdateTrainJobStatusRequest.from_dict(body)
    except ValidationError as error:
        return [*problems, f"not an UpdateTrainJobStatusRequest: {error}"]
    progress = status.get("progressPercentage")
    if progress is not None and not 0 <= progress <= 100:
        problems.append(f"progressPercentage {progress} is not in 0-100")
    remaining = status.get("estimatedRemainingSeconds")
    if remaining is not None and not 0 <= remaining < 2**31:
        problems.append(f"estimatedRemainingSeconds {remaining} is not a non-negative int32")
    if len(metrics) > 256:
        problems.append(f"{len(metrics)} metrics, more than 256")
    for metric in metrics:
        for key in ("name", "value"):
            if not 1 <= len(metric[key]) <= 64:
                problems.append(f"metric {key} {metric[key]!r} is not 1-64 characters")
    if not RFC3339.match(str(status.get("lastUpdatedTime", ""))):
        problems.append(f"lastUpdatedTime {status.get('lastUpdatedTime')!r} is missing or not RFC 3339")
    return problems


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA made now, and a certificate it signed for 127.0.0.1: (ca.crt, server.crt, server.key)."""
    now = datetime.datetime.now(datetime.UTC)

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("test trainer CA")).issuer_name(name("test trainer CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    server = (x509.CertificateBuilder().subject_name(name("kubeflow-trainer-controller-manager"))
              .issuer_name(ca.subject).public_key(server_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
              .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                             critical=False)
              .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA256()))
    paths = folder / "ca.crt", folder / "server.crt", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return paths


class TrainerStatusServer:
    """The server, its CA certificate's and token's files (as the controller mounts them), what it took."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.ca_cert_file, cert, key = _certificates(folder)
        self.token_file = folder / "token"
        self.token_file.write_text(TOKEN + "\n")  # the kubelet's file ends with no newline; a reader must strip
        self.reports: list[dict[str, Any]] = []  # each valid request's trainerStatus, in order
        self.requests = 0  # every request, valid or not
        self.problems: list[str] = []
        self.wrong_tokens_expected = False  # True: a wrong token is answered 403 and is no problem of the test
        self.answer = 200  # what a valid request is answered with
        self.held = threading.Event()  # set while a request is held
        self.release = threading.Event()
        self.release.set()  # cleared: each valid request is held until it is set again
        self._changed = threading.Condition()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self._http.socket = context.wrap_socket(self._http.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self._http.server_address[1]}{PATH}"
        self._thread = threading.Thread(target=self._serve, name="status-server", daemon=True)
        self._thread.start()

    def environment(self) -> dict[str, str]:
        """The variables Kubeflow Trainer's controller injects into a trainer container."""
        return {"KUBEFLOW_TRAINER_SERVER_URL": self.url, "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(self.ca_cert_file),
                "KUBEFLOW_TRAINER_SERVER_TOKEN": str(self.token_file)}

    def wait_for(self, condition: Callable[[TrainerStatusServer], bool], timeout_s: float = 30.0) -> bool:
        """Whether ``condition(self)`` came to hold within ``timeout_s`` (woken by each request and report)."""
        with self._changed:
            return self._changed.wait_for(lambda: condition(self), timeout_s)

    def _counted(self) -> None:
        with self._changed:
            self.requests += 1
            self._changed.notify_all()

    def close(self) -> None:
        self.release.set()
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(10)
        if self._thread.is_alive():
            self.problems.append("the server's thread did not stop")

    def _serve(self) -> None:
        try:
            self._http.serve_forever(poll_interval=0.05)
        except BaseException:  # noqa: BLE001 - a server that died fails the test (the fixture reads problems)
            self.problems.append(f"the server's thread died:\n{traceback.format_exc()}")

    def _take(self, handler: BaseHTTPRequestHandler) -> tuple[int, dict[str, Any]]:
        self._counted()
        if handler.path != PATH:
            self.problems.append(f"POST to {handler.path}, not {PATH}")
            return 404, {"message": "Not found"}
        if handler.headers.get("Authorization") != f"Bearer {TOKEN}":
            if self.wrong_tokens_expected:
                return 403, {"message": "Forbidden"}
            self.problems.append(f"Authorization {handler.headers.get('Authorization')!r}, not the token's")
            return 403, {"message": "Forbidden"}
        if handler.headers.get("Content-Type") != "application/json":
            self.problems.append(f"Content-Type {handler.headers.get('Content-Type')!r}")
        body = json.loads(handler.rfile.read(int(handler.headers.get("Content-Length", 0))))
        problems = request_problems(body)
        if problems:
            self.problems += problems
            return 422, {"message": "; ".join(problems)}
        if not self.release.is_set():
            self.held.set()
            self.release.wait(HOLD_AT_MOST_S)
            self.held.clear()
        with self._changed:
            self.reports.append(body["trainerStatus"])
            self._changed.notify_all()
        return self.answer, (body if self.answer == 200 else {"message": f"refused with {self.answer}"})

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                try:
                    code, answer = server._take(self)
                except Exception:  # noqa: BLE001 - kept for the fixture, which fails the test
                    server.problems.append(f"the server failed:\n{traceback.format_exc()}")
                    code, answer = 500, {"message": "Internal error"}
                payload = json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:  # noqa: N802 - the controller serves only POST
                server.problems.append(f"GET {self.path}: the status server takes only POST")
                self.send_response(405)
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        return Handler
