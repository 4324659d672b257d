"""The ``kdray`` command: flags generated from the settings dataclasses, ``generate`` on token ids and
through a chat template, ``serve``'s safe defaults."""
import dataclasses

import pytest
import torch
from serve_server import make_chat_checkpoint

from kdray import LLM, SamplingParams
from kdray.cli import _parser, check_serve, given, main
from kdray.engine.args import EngineArgs
from kdray.serve.args import ServeArgs
from kdray.serve.server import open_without_key


def greedy_ids(llm, prompt, n):
    return llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=n))[0].outputs[0]


def test_every_setting_has_a_flag_with_help():
    parser = _parser()
    for command, cls in (("generate", EngineArgs), ("serve", ServeArgs)):
        sub = parser._subparsers._group_actions[0].choices[command]
        flags = {a.dest: a for a in sub._actions}
        for f in dataclasses.fields(cls):
            if f.name == "autoscaling_config":  # a dict: set in a Serve config file
                continue
            assert f.name in flags, f"kdray {command} has no flag for {f.name}"
            assert flags[f.name].help and flags[f.name].default is None


def test_flags_left_out_keep_the_dataclass_defaults_and_values_convert():
    args = _parser().parse_args(["generate", "x", "--budget", "16", "--no-cuda-graphs", "--tp", "2"])
    assert EngineArgs(**given(_parser().parse_args(["generate", "x", "--budget", "auto"]), EngineArgs)).budget == "auto"
    engine = EngineArgs(**given(args, EngineArgs))
    assert (engine.budget, engine.cuda_graphs, engine.tp, engine.max_num_seqs) == (16, False, 2, EngineArgs().max_num_seqs)
    assert EngineArgs(**given(_parser().parse_args(["generate", "x"]), EngineArgs)) == EngineArgs()


def test_cuda_graphs_follow_the_device_unless_turned_off(monkeypatch):
    assert EngineArgs().resolve().cuda_graphs is torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineArgs(model="k2-tiny").resolve().cuda_graphs is True
    assert EngineArgs(model="k2-tiny", cuda_graphs=False).resolve().cuda_graphs is False
    assert EngineArgs(model="k2-tiny", device="cpu").resolve().cuda_graphs is False
    assert ServeArgs.parse({"cuda_graphs": "false"}).cuda_graphs is False


@pytest.mark.parametrize("field,value,message", [
    ("budget", -1, "budget=-1 must be 'auto' or a number of draft nodes"), ("spec", "tree", "spec='tree' must be one of"),
    ("page_size", 12, "page_size=12 must be a power of two"), ("dtype", "int8", "dtype='int8' must be one of"),
    ("tp", 2, "distributed='local' must be 'ray' for tp=2")])
def test_bad_settings_name_the_field(field, value, message):
    kw = {field: value} | ({"distributed": "local"} if field == "tp" else {})
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(**kw)


def test_cli_generate_prints_tokens_and_tau(capsys):
    tiny = LLM(model="k2-tiny", device="cpu")
    assert main(["generate", "5,6,7,8,9", "--token-ids", "--model", "k2-tiny", "--max-tokens", "4",
                 "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == ",".join(map(str, greedy_ids(tiny, [5, 6, 7, 8, 9], 4).token_ids))
    assert err.startswith("tau 1.00")
    assert main(["generate", "5,x", "--token-ids"]) == 2
    assert "comma-separated" in capsys.readouterr().err
    assert main(["generate", "5", "--token-ids", "--model", "k2-tiny", "--budget", "many"]) == 2
    assert "budget='many'" in capsys.readouterr().err


def test_cli_generate_uses_the_chat_template_unless_raw(capsys, tmp_path):
    model = make_chat_checkpoint(tmp_path / "chat")
    chat_llm = LLM(model=str(model), device="cpu")
    tok = chat_llm.tokenizer
    seen = []
    for flags, prompt in (([], tok.apply_chat_template([{"role": "user", "content": "hello"}])), (["--raw"], "hello")):
        assert main(["generate", "hello", "--model", str(model), "--max-tokens", "3", "--device", "cpu",
                     *flags]) == 0
        expect = greedy_ids(chat_llm, tok.encode(prompt), 3).token_ids
        seen.append(capsys.readouterr().out.rstrip("\n"))
        assert seen[-1] == tok.decode(expect)
    assert seen[0] != seen[1]  # the template changed what the model saw


def test_kdray_serve_listens_on_this_machine_unless_told_otherwise():
    assert _parser().parse_args(["serve"]).host == "127.0.0.1"
    assert open_without_key("127.0.0.1", None) is None and open_without_key("::1", None) is None
    assert open_without_key("localhost", None) is None and open_without_key("0.0.0.0", "sk-x") is None
    assert "no API key is set" in open_without_key("0.0.0.0", None)
    assert "no API key is set" in open_without_key("10.0.0.5", None)


def test_kdray_serve_warns_when_it_listens_beyond_loopback_without_a_key(monkeypatch, capsys):
    import ray

    monkeypatch.delenv("KDRAY_API_KEY", raising=False)
    monkeypatch.setattr(ray, "init", lambda **kw: (_ for _ in ()).throw(ValueError("stop here")))
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    assert "warning: Serve listens on 0.0.0.0 and no API key is set" in capsys.readouterr().err
    assert main(["serve", "--host", "0.0.0.0", "--api-key", "sk-x"]) == 2
    assert "warning" not in capsys.readouterr().err


def test_kdray_serve_ingress_sets_the_env_of_the_cluster_it_starts(monkeypatch, capsys):
    import os

    import ray

    seen = []
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("KDRAY_API_KEY", "sk-x")

    def init(**kw):
        seen.append(os.environ.get("RAY_SERVE_ENABLE_HA_PROXY"))
        raise ValueError("stop here")

    monkeypatch.setattr(ray, "init", init)
    assert main(["serve"]) == 2
    assert main(["serve", "--ingress", "haproxy"]) == 2
    assert seen == [None, "1"]  # Ray's processes inherit the driver's environment
    assert main(["serve", "--ingress", "haproxy", "--address", "auto"]) == 2
    assert seen == [None, "1"] and "export it before `ray start`" in capsys.readouterr().err


@pytest.mark.slow
def test_kdray_serve_refuses_a_running_serve_with_other_http_options(serve_cluster, monkeypatch):
    from types import SimpleNamespace

    from ray import serve

    with pytest.raises(ValueError, match=rf"already runs on this cluster at 127.0.0.1:{serve_cluster.port} .* "
                                         rf"--port {serve_cluster.port}"):
        check_serve("127.0.0.1", serve_cluster.port + 1, replace=False)
    check_serve("127.0.0.1", serve_cluster.port, replace=False)  # the same options, no kdray app: go ahead
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={"kdray": None}))
    with pytest.raises(ValueError, match="an app named 'kdray' already runs.*--replace"):
        check_serve("127.0.0.1", serve_cluster.port, replace=False)
    check_serve("127.0.0.1", serve_cluster.port, replace=True)
