import json

from ds_optimus import demo


def test_demo_trains_saves_and_reloads(tmp_path, capsys):
    out = tmp_path / "demo"
    code = demo.main(["--steps", "12", "--batch-size", "4", "--seq-len", "64", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0  # the demo itself fails when the held-out loss does not fall
    assert json.loads((out / "config.json").read_text())["model_type"] == "mula"
    assert (out / "model.safetensors").is_file()
    assert "loaded back as MulaForCausalLM" in printed
    before, after = (float(v) for v in printed.split("held-out loss ")[1].split(" after")[0].split(" -> "))
    assert after < before


def test_embedded_corpus_is_real_text():
    data = demo.embedded_corpus()
    assert len(data) > 300_000
    assert b'The "with" statement' in data
    assert demo.decode(demo.encode(b"def f(x):\n")) == "def f(x):\n"
