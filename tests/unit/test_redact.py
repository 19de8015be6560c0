"""trainer.redact: the password and query values of every URL in a text, nothing else."""

from __future__ import annotations

import pytest

from trainer.redact import redact, redacted


@pytest.mark.parametrize(("text", "shown"), [
    ("ftp://alice:PASSWORD@127.0.0.1:9/mnist", "ftp://alice:***@127.0.0.1:9/mnist"),
    ("s3://bucket/data?X-Amz-Signature=abc&X-Amz-Credential=AKIA",
     "s3://bucket/data?X-Amz-Signature=***&X-Amz-Credential=***"),
    ("--data-dir https://u:p:q@host/d/?sig=x#part: cannot reach it",
     "--data-dir https://u:***@host/d/?sig=***#part: cannot reach it"),
    ("(see 'az://c/blob?sv=2024&sig=z').", "(see 'az://c/blob?sv=***&sig=***')."),
    ("http://alice@host/data", "http://alice@host/data"),  # a user name alone is no secret
    ("s3://bucket/path/to/data", "s3://bucket/path/to/data"),
    ("/data/mnist and a:b@c without a scheme", "/data/mnist and a:b@c without a scheme"),
])
def test_passwords_and_query_values_of_urls_are_hidden(text, shown):
    assert redact(text) == shown


def test_a_config_is_redacted_everywhere_and_left_unchanged():
    config = {"task": {"data_dir": "ftp://a:pw@h/x", "sizes": [1, "https://h/?t=1"]}, "epochs": 3}
    assert redacted(config) == {"task": {"data_dir": "ftp://a:***@h/x", "sizes": [1, "https://h/?t=***"]}, "epochs": 3}
    assert config["task"]["data_dir"] == "ftp://a:pw@h/x"
