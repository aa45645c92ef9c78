"""Environment export: prefixes, --export/--export-prefix, env files, reserved names, exact values."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticzero.errors import UsageError
from elasticzero.launch.envexport import export_env, parse_env_file, read_env_files, select_env

HOSTILE = "a;echo PWNED $(touch /tmp/x) `id` 'q' \"dq\" # * ?\nline2"


def test_default_prefixes_and_names() -> None:
    environ = {
        "NCCL_DEBUG": "INFO",
        "PYTHONPATH": "/src",
        "UCX_TLS": "tcp",
        "MV2_X": "1",
        "MLFLOW_URI": "u",
        "WANDB_MODE": "off",
        "HF_HOME": "/hf",
        "TORCH_LOGS": "x",
        "OMP_NUM_THREADS": "2",
        "HOME": "/root",
        "PATH": "/bin",
        "OMP_PROC_BIND": "true",
        "TORCHELASTIC_RUN_ID": "r",
        "PYTHONHOME": "/opt/py",
        "PYTHONEXECUTABLE": "/opt/py/bin/python",
    }
    out = select_env(environ)
    assert list(out) == sorted(out)
    assert set(out) == {
        "NCCL_DEBUG",
        "PYTHONPATH",
        "UCX_TLS",
        "MV2_X",
        "MLFLOW_URI",
        "WANDB_MODE",
        "HF_HOME",
        "TORCH_LOGS",
        "OMP_NUM_THREADS",
    }


def test_explicit_names_and_prefixes() -> None:
    environ = {"FOO": "1", "MYAPP_A": "2", "MYAPP_B": "3", "PYTHONHOME": "/opt", "RANK": "0"}
    out = select_env(environ, names=["FOO", "PYTHONHOME"], prefixes=["MYAPP_"])
    assert out == {"FOO": "1", "MYAPP_A": "2", "MYAPP_B": "3", "PYTHONHOME": "/opt"}
    # a prefix never drags in names the agent sets per rank
    assert select_env({"RANK": "0", "ROLE_NAME": "x"}, prefixes=["R"]) == {}


def test_hostile_values_survive_exactly() -> None:
    assert select_env({"NCCL_X": HOSTILE}, names=[]) == {"NCCL_X": HOSTILE}


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"names": ["NOT_SET"]}, "--export NOT_SET: NOT_SET is not set in the environment or any env file"),
        ({"names": ["1BAD"]}, "--export '1BAD': invalid variable name"),
        ({"names": ["A-B"]}, "--export 'A-B': invalid variable name"),
        ({"names": ["MASTER_ADDR"]}, "--export MASTER_ADDR: set per rank by the agent"),
        ({"names": ["TORCHELASTIC_RUN_ID"]}, "--export TORCHELASTIC_RUN_ID: set per rank by the agent"),
        ({"prefixes": [""]}, "--export-prefix '': a prefix is the start of a name"),
        ({"prefixes": ["A B"]}, "--export-prefix 'A B'"),
    ],
)
def test_bad_export_flags(kwargs: dict[str, list[str]], words: str) -> None:
    with pytest.raises(UsageError) as err:
        select_env({"FOO": "1"}, **kwargs)
    assert str(err.value).startswith(words)


def test_export_of_a_name_only_in_an_env_file_is_fine() -> None:
    assert select_env({}, names=["ONLY_IN_FILE"], files={"ONLY_IN_FILE": "v"}) == {"ONLY_IN_FILE": "v"}


def test_env_file_syntax() -> None:
    text = "\n".join(
        [
            "# comment",
            "",
            "   # indented comment",
            "PLAIN=hello world  ",
            "export EXPORTED=1",
            "export\tTABBED=2",
            "SQ='a;b $(x) \"c\" # d'  # trailing comment",
            'DQ="x \\"y\\" \\\\ \\$HOME `q` \\n"',
            "HASH=a#b",
            "EMPTY=",
            "EQ=a=b=c",
            "DOLLAR=$HOME",
            "SPACES='  padded  '",
        ]
    )
    out = parse_env_file(text, "f")
    assert out == {
        "PLAIN": "hello world",
        "EXPORTED": "1",
        "TABBED": "2",
        "SQ": 'a;b $(x) "c" # d',
        "DQ": 'x "y" \\ $HOME `q` \\n',
        "HASH": "a#b",
        "EMPTY": "",
        "EQ": "a=b=c",
        "DOLLAR": "$HOME",
        "SPACES": "  padded  ",
    }


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("OK=1\nNOEQUALS\n", 2, "expected KEY=VALUE"),
        ("1BAD=x\n", 1, "invalid variable name '1BAD'"),
        ("\n\nA-B=x\n", 3, "invalid variable name 'A-B'"),
        ("=x\n", 1, "invalid variable name ''"),
        ("export =x\n", 1, "invalid variable name ''"),
        ("A='open\n", 1, "missing closing '"),
        ('A="open\n', 1, 'missing closing "'),
        ("A='x' y\n", 1, "unexpected 'y' after the closing '"),
        ("RANK=3\n", 1, "RANK is set per rank by the agent"),
        ("CUDA_VISIBLE_DEVICES=0\n", 1, "CUDA_VISIBLE_DEVICES is set per rank"),
    ],
)
def test_bad_env_file_lines_name_file_and_line(text: str, line: int, words: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_env_file(text, "/h/.elasticzero_env")
    msg = str(err.value)
    assert msg.startswith(f"/h/.elasticzero_env:{line}: ")
    assert words in msg


def test_env_files_precedence_cwd_wins_and_elasticzero_over_deepspeed(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home-ds\nB=home-ds\nC=home-ds\nD=home-ds\n")
    (home / ".elasticzero_env").write_text("B=home-ez\nC=home-ez\nD=home-ez\n")
    (cwd / ".deepspeed_env").write_text("C=cwd-ds\nD=cwd-ds\n")
    (cwd / ".elasticzero_env").write_text("D=cwd-ez\n")
    assert read_env_files(home, cwd) == {"A": "home-ds", "B": "home-ez", "C": "cwd-ds", "D": "cwd-ez"}


def test_env_files_override_the_environment(tmp_path: Path) -> None:
    (tmp_path / ".elasticzero_env").write_text("NCCL_DEBUG=WARN\nMY_TOKEN='s3cret;x'\n")
    out = export_env({"NCCL_DEBUG": "INFO", "HOME": str(tmp_path)}, cwd=tmp_path)
    assert out == {"MY_TOKEN": "s3cret;x", "NCCL_DEBUG": "WARN"}


def test_bad_env_file_in_home_names_it(tmp_path: Path) -> None:
    (tmp_path / ".deepspeed_env").write_text("GOOD=1\nBAD KEY=2\n")
    with pytest.raises(UsageError, match=r"\.deepspeed_env:2: invalid variable name 'BAD KEY'"):
        export_env({"HOME": str(tmp_path)}, cwd=tmp_path / "nowhere")
