"""trainer.redact: every credential a URL in a text can carry, and nothing else."""

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
    ("https://ghp_TOKEN@github.com/org/repo.git", "https://***@github.com/org/repo.git"),  # a token as user name
    ("ftp://u:S1@S2/S3?S4#S5@host:21/c?k=v", "ftp://u:***@host:21/c?k=***"),  # a password with @ / ? # in it
    ("https://host/cb#access_token=TOKEN&state=S", "https://host/cb#access_token=***&state=***"),
    ("https://host/docs/page#section", "https://host/docs/page#section"),  # a bare fragment names a place
    ("s3://bucket/logo@2x.png and s3://b/k?v=1@x", "s3://bucket/logo@2x.png and s3://b/k?v=***"),  # "@" in paths
    ("s3://bucket/path/to/data", "s3://bucket/path/to/data"),
    ("/data/mnist and a:b@c without a scheme", "/data/mnist and a:b@c without a scheme"),
])
def test_every_credential_of_a_url_is_hidden(text, shown):
    assert redact(text) == shown


def test_a_config_is_redacted_everywhere_and_left_unchanged():
    config = {"task": {"data_dir": "ftp://a:pw@h/x", "sizes": [1, "https://h/?t=1"]}, "epochs": 3}
    assert redacted(config) == {"task": {"data_dir": "ftp://a:***@h/x", "sizes": [1, "https://h/?t=***"]}, "epochs": 3}
    assert config["task"]["data_dir"] == "ftp://a:pw@h/x"


@pytest.mark.parametrize(("argv", "shown", "secrets"), [
    (["--datadir", "s3://AKIA:SECRET@bucket/x", "--token=SECRET2"],
     "ddp-train: error: unrecognized arguments: --datadir --token (and 2 value(s), not shown)", ("SECRET",)),
    (["--epochs", "s3://u:SECRET3@h/x"], "argument --epochs: invalid int value: 's3://u:***@h/x'", ("SECRET3",)),
    (["--data=ghp_PLAINTOKEN"], "ambiguous option: --data could match --dataset, --data-dir", ("PLAINTOKEN",)),
    (["--tensorboard=TOKEN9"], "ignored explicit argument (not shown)", ("TOKEN9",)),
    (["-pSECRET5", "--x=SECRET6"], "unrecognized arguments: -p --x (and 2 value(s), not shown)",
     ("SECRET5", "SECRET6")),
])
def test_the_command_lines_own_errors_show_no_secret(argv, shown, secrets, capsys):
    """argparse's own error lines echo what was typed: every entry point's parser redacts them."""
    from trainer.cli import parse_config
    from trainer.doctor.cli import main as doctor
    from trainer.export import main as export

    with pytest.raises(SystemExit) as raised:
        parse_config(argv)
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert shown in error and not any(secret in error for secret in secrets), error
    for main in (export, doctor):
        with pytest.raises(SystemExit):
            main(["--unknown", "s3://u:SECRET4@h/x", "x", "y"])
        error = capsys.readouterr().err
        assert "--unknown" in error and "SECRET4" not in error, error


def test_a_secret_quoted_without_its_scheme_is_hidden_when_the_url_is_known():
    """A storage client's own message quotes the bucket part of the URL, credentials and all."""
    url = "s3://AKIA:CKSECRET@bucket/x?sig=SIGNATURE"
    said = 'Invalid bucket name "AKIA:CKSECRET@bucket" (signed SIGNATURE) for s3://AKIA:CKSECRET@bucket/x'
    assert redact(said, url) == 'Invalid bucket name "AKIA:***@bucket" (signed ***) for s3://AKIA:***@bucket/x'
    assert redact("token TOKEN@host", "https://TOKEN@host/repo") == "token ***@host"


def test_help_shows_a_config_files_url_redacted(tmp_path, capsys):
    from trainer.cli import parse_config

    config = tmp_path / "job.yaml"
    config.write_text("checkpoint_dir: s3://AKIA:HELPSECRET@bucket/x\n")
    with pytest.raises(SystemExit):
        parse_config(["--config", str(config), "--help"])
    shown = capsys.readouterr().out
    assert "s3://AKIA:***@bucket/x" in shown and "HELPSECRET" not in shown
