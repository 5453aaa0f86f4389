"""``infer bench serving --peer llama-server`` / ``--peer-server URL`` without building llama.cpp: the
build's CPU flags from cpuinfo text, the build's reuse, and the comparison against stand-in servers
(in-process fakes for infer's side and ``--peer-server``, a fake ``llama-server`` binary for ``--peer``)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_openai_server import serve_in_thread, stop

from infer.bench import llama_server
from infer.bench.peer_serving import Target, compare, llama_mode_args, llama_modes, run_requests
from infer.cli import main

SAPPHIRE_RAPIDS_VM = ("fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 avx512f avx512dq avx512cd "
                      "avx512bw avx512vl avx512ifma avx512vbmi avx512_vbmi2 avx512_vnni avx512_bf16 avx_vnni "
                      "avx512_fp16 amx_bf16 amx_tile amx_int8")
HASWELL = "fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2"
ARM = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp"


def _options(flags: str) -> dict[str, str]:
    return dict(f.removeprefix("-D").split("=") for f in llama_server.cmake_flags(set(flags.split())))


def test_cmake_flags_name_every_cpu_feature_and_never_amx() -> None:
    options = _options(SAPPHIRE_RAPIDS_VM)
    assert options["GGML_NATIVE"] == "OFF"  # a native build would turn AMX on
    for on in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_AVX_VNNI", "GGML_AVX512",
               "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"):
        assert options[on] == "ON", on
    for off in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"):
        assert options[off] == "OFF", off


def test_cmake_flags_with_amx_turn_on_the_amx_the_cpu_reports() -> None:
    options = dict(f.removeprefix("-D").split("=")
                   for f in llama_server.cmake_flags(set(SAPPHIRE_RAPIDS_VM.split()), amx=True))
    assert options["GGML_NATIVE"] == "OFF" and options["GGML_AVX512_VNNI"] == "ON"
    for on in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"):
        assert options[on] == "ON", on
    # Only the AMX parts reported: no amx_bf16, no GGML_AMX_BF16.
    partial = dict(f.removeprefix("-D").split("=")
                   for f in llama_server.cmake_flags(set(SAPPHIRE_RAPIDS_VM.split()) - {"amx_bf16"}, amx=True))
    assert partial["GGML_AMX_INT8"] == "ON" and partial["GGML_AMX_BF16"] == "OFF"
    for lacking in (HASWELL, ARM, HASWELL + " amx_tile amx_int8"):
        with pytest.raises(ValueError, match="amx"):
            llama_server.cmake_flags(set(lacking.split()), amx=True)


def test_cmake_flags_leave_out_what_the_cpu_lacks() -> None:
    options = _options(HASWELL)
    assert options["GGML_AVX2"] == options["GGML_FMA"] == options["GGML_BMI2"] == "ON"
    assert options["GGML_AVX512"] == options["GGML_AVX512_VNNI"] == options["GGML_AVX512_BF16"] == "OFF"
    assert options["GGML_AVX_VNNI"] == "OFF"
    # An AVX-512 extension without the whole AVX-512 base that GGML_AVX512 compiles for is not used.
    partial = _options(HASWELL + " avx512f avx512_vnni")
    assert partial["GGML_AVX512"] == partial["GGML_AVX512_VNNI"] == "OFF"
    assert llama_server.cmake_flags(set(ARM.split())) == []  # another architecture: a native build


def test_cpu_flags_reads_the_first_flags_line() -> None:
    cpuinfo = f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {HASWELL}\nbugs\t\t: spectre_v1\n" \
              f"processor\t: 1\nflags\t\t: {HASWELL} avx512f\n"
    assert llama_server.cpu_flags(cpuinfo) == set(HASWELL.split())
    assert llama_server.cpu_flags("Features\t: fp asimd\n") == set()


def _sdist(root: Path) -> Path:
    """A stand-in llama-cpp-python sdist: a tarball holding vendor/llama.cpp/CMakeLists.txt."""
    src = root / "src" / "llama_cpp_python-9.9.9" / "vendor" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("project(fake)\n")
    (src.parent.parent / "CHANGELOG.md").write_text("# Changelog\n\n## [Unreleased]\n\n## [9.9.9]\n\n"
                                                    "- fix: something\n- feat: update llama.cpp to "
                                                    "ggml-org/llama.cpp@abc1234\n\n## [9.9.8]\n\n"
                                                    "- feat: update llama.cpp to ggml-org/llama.cpp@0ld0000\n")
    with tarfile.open(root / "llama_cpp_python-9.9.9.tar.gz", "w:gz") as tar:
        tar.add(root / "src" / "llama_cpp_python-9.9.9", arcname="llama_cpp_python-9.9.9")
    return root / "llama_cpp_python-9.9.9" / "vendor" / "llama.cpp"


def _fake_builds(monkeypatch: pytest.MonkeyPatch, cpu: str) -> list[list[str]]:
    """cmake runs recorded, not run, on a CPU with these cpuinfo flags; a build makes its llama-server."""
    monkeypatch.setattr(llama_server, "host_cmake_flags",
                        lambda amx=False: llama_server.cmake_flags(set(cpu.split()), amx=amx))
    commands: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(cmd)
        if "--build" in cmd:
            bin_dir = Path(cmd[cmd.index("--build") + 1]) / "bin"
            bin_dir.mkdir(parents=True, exist_ok=True)
            (bin_dir / "llama-server").write_text("")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(llama_server.subprocess, "run", fake_run)
    return commands


def test_build_configures_with_the_cpu_flags_then_reuses_the_build(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    source = _sdist(tmp_path)
    commands = _fake_builds(monkeypatch, HASWELL)
    server = llama_server.build(tmp_path, jobs=2, log=sys.stderr)
    assert server == source / "build" / "bin" / "llama-server"
    configure, compile_ = commands
    assert configure[:3] == ["cmake", "-S", str(source)]
    for flag in ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON",
                 "-DGGML_AVX512=OFF", "-DGGML_AMX_TILE=OFF"):
        assert flag in configure
    assert compile_[-5:] == ["-j", "2", "--target", "llama-server", "llama-bench"]
    info = llama_server.build_info(server)
    assert info["llama_cpp_python"] == "9.9.9" and "-DGGML_AVX2=ON" in info["configure"]
    assert info["llama_cpp_commit"] == "abc1234"
    # Built: a second call runs nothing.
    commands.clear()
    assert llama_server.build(tmp_path, log=sys.stderr) == server
    assert commands == []
    assert info["amx"] is False


def test_build_with_amx_goes_to_its_own_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _sdist(tmp_path)
    commands = _fake_builds(monkeypatch, SAPPHIRE_RAPIDS_VM)
    amx = llama_server.build(tmp_path, log=sys.stderr, amx=True)
    assert amx == source / "build-amx" / "bin" / "llama-server"
    assert "-DGGML_AMX_INT8=ON" in commands[0] and str(source / "build-amx") in commands[0]
    info = llama_server.build_info(amx)
    assert info["amx"] is True and info["llama_cpp_commit"] == "abc1234"
    # The default build is another folder, AMX off; the AMX one stays as built.
    plain = llama_server.build(tmp_path, log=sys.stderr)
    assert plain == source / "build" / "bin" / "llama-server" and "-DGGML_AMX_INT8=OFF" in commands[2]
    assert llama_server.build(tmp_path, log=sys.stderr, amx=True) == amx and len(commands) == 4


def test_llama_modes_take_the_ngram_types_the_binary_has() -> None:
    assert llama_modes(None, ["none", "ngram-simple", "ngram-map-k"]) == ["plain", "ngram-simple"]
    assert llama_modes(None, []) == ["plain"]
    assert llama_modes(["plain", "ngram-map-k"], ["none", "ngram-map-k"]) == ["plain", "ngram-map-k"]
    with pytest.raises(ValueError, match="ngram-mod"):
        llama_modes(["ngram-mod"], ["none", "ngram-simple"])
    tuned = "ngram-simple --spec-ngram-simple-size-n 4"
    assert llama_modes([tuned], ["ngram-simple"]) == [tuned]
    assert llama_mode_args(tuned) == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4"]
    assert llama_mode_args("plain") == []


def test_requests_are_the_same_for_every_server_and_take_turns() -> None:
    log: list[tuple[str, str]] = []
    servers = [serve_in_thread(log=log, name=name) for name in ("a", "b", "c")]
    try:
        targets = [Target(name, "infer", url, "fake") for name, (_, url) in zip("abc", servers, strict=True)]
        kinds = {"chat": ["one two three", "four five"], "summary": ["six seven"]}
        run_requests(targets, kinds, repeats=2, max_tokens=2, temperature=0.0, seed=0, ignore_eos=False,
                     warmup=False)
    finally:
        for server, _ in servers:
            stop(server)
    requests = [log[i:i + 3] for i in range(0, len(log), 3)]
    assert len(requests) == 6
    for turn in requests:  # each request goes to every server before the next request starts
        assert sorted(name for name, _ in turn) == ["a", "b", "c"] and len({p for _, p in turn}) == 1
    assert [turn[0][0] for turn in requests] == ["a", "b", "c", "a", "b", "c"]  # who goes first rotates
    assert targets[0].texts == {"chat": ["three two", "five four"] * 2, "summary": ["seven six"] * 2}
    assert targets[0].tokens["chat"] == [2, 2, 2, 2]
    assert targets[0].repeats == {"chat": [0, 0, 1, 1], "summary": [0, 1]}


def _target(label: str, side: str, texts: list[str], rate: float) -> Target:
    t = Target(label, side, "http://x", "m")
    for text in texts:
        t.record("chat", rate, 4, text, 0)
    t.record("chat", rate * 3, 4, texts[0], 1)  # a second repeat of the first prompt, three times as fast
    t.texts["chat"][-1] = texts[0]
    return t


def test_compare_reports_ratios_best_modes_and_text_agreement() -> None:
    plain = _target("plain", "infer", ["x", "y"], 100.0)
    ngram = _target("ngram", "infer", ["x", "y"], 150.0)
    peer = _target("peer plain", "peer", ["x", "z"], 50.0)
    peer_spec = _target("peer spec", "peer", ["q", "z"], 75.0)
    out = compare([plain, ngram, peer, peer_spec], ["chat"])
    assert out["greedy_text_identical_across_infer_modes"] is True
    rows = {r["label"]: r["kinds"]["chat"] for r in out["rows"]}
    assert rows["ngram"]["vs_infer_plain"] == pytest.approx(1.5)
    assert rows["peer spec"]["vs_peer_plain"] == pytest.approx(1.5)
    assert rows["peer plain"]["text_same_as_infer_plain"] == "2/3"
    assert rows["peer spec"]["text_same_as_infer_plain"] == "0/3"
    assert rows["plain"]["tok_s"] == 100.0 and rows["plain"]["first_repeat_tok_s"] == 100.0
    assert rows["ngram"]["samples"] == [150.0, 150.0, 450.0]
    best = out["best"]["chat"]
    assert best["infer"]["label"] == "ngram" and best["peer"]["label"] == "peer spec"
    assert best["infer_vs_peer"] == pytest.approx(2.0) and best["infer_plain_vs_peer_plain"] == pytest.approx(2.0)
    # A speculative mode whose greedy text differs from plain decoding's is reported as such.
    wrong = _target("broken", "infer", ["x", "w"], 200.0)
    assert compare([plain, wrong, peer], ["chat"])["greedy_text_identical_across_infer_modes"] is False


@pytest.fixture()
def fake_binary(tmp_path: Path) -> Path:
    """An executable ``llama-server`` that runs the fake server."""
    script = Path(__file__).with_name("fake_openai_server.py")
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    binary.chmod(0o755)
    return binary


def test_spec_types_and_version_come_from_the_binary(fake_binary: Path) -> None:
    assert llama_server.spec_types(fake_binary) == ["none", "draft-simple", "ngram-simple", "ngram-map-k"]
    assert llama_server.server_version(fake_binary) == "version: 1 (fake)"


def test_peer_llama_server_and_peer_server_get_the_same_requests(tmp_path: Path, fake_binary: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    argv_dir = tmp_path / "argv"
    argv_dir.mkdir()
    monkeypatch.setenv("FAKE_LLAMA_ARGV_DIR", str(argv_dir))
    fakes = [serve_in_thread(), serve_in_thread(), serve_in_thread(prefix="other: ")]
    (_, url_a), (_, url_b), (_, url_peer) = fakes
    out = tmp_path / "out"
    try:
        code = main(["bench", "serving", "--server", url_a, url_b, "--label", "speculation off", "ngram K=4",
                     "--peer", "llama-server", "--peer-binary", str(fake_binary), "--peer-model", str(gguf),
                     "--peer-server", url_peer, "--peer-label", "other", "--peer-prompts", "2", "--peer-repeats",
                     "2", "--max-tokens", "5", "--threads", "2", "--context", "512", "--out", str(out)])
        bodies = [httpx.get(f"{url}/debug/requests").json() for url in (url_a, url_peer)]
    finally:
        for server, _ in fakes:
            stop(server)
    assert code == 0
    report = json.loads((out / "serving-peer.json").read_text())
    rows = {r["label"]: r for r in report["comparison"]["rows"]}
    assert list(rows) == ["speculation off", "ngram K=4", "other", "llama-server plain", "llama-server ngram-simple"]
    assert report["peer"]["modes"] == ["plain", "ngram-simple"]  # the fake offers no ngram-mod
    for row in rows.values():
        if row["label"].startswith("llama-server"):
            with pytest.raises(httpx.HTTPError):  # every llama-server the bench started is stopped
                httpx.get(f"{row['url']}/health", timeout=2)

    # llama-server ran the same file with the same threads and context, once per mode.
    started = [json.loads(p.read_text()) for p in sorted(argv_dir.iterdir())]
    assert len(started) == 2
    for argv in started:
        assert argv[argv.index("-m") + 1] == str(gguf)
        assert argv[argv.index("-t") + 1] == "2" and argv[argv.index("-c") + 1] == "512"
    assert sorted(argv[argv.index("--spec-type") + 1] if "--spec-type" in argv else "plain"
                  for argv in started) == ["ngram-simple", "plain"]

    # Every server got the same chat requests: greedy, prompt cache off, in the same order.
    infer_bodies, peer_bodies = bodies
    assert [b["messages"] for b in infer_bodies] == [b["messages"] for b in peer_bodies]
    assert len(infer_bodies) == 1 + 3 * 2 * 2  # a warm-up, then 3 kinds x 2 prompts x 2 repeats
    assert all(b["temperature"] == 0.0 and b["max_tokens"] == 5 and b["cache_prompt"] is False
               and b["stream"] is False for b in infer_bodies)

    kinds = report["settings"]["peer_kinds"]
    assert kinds == ["chat", "summary", "code-edit"]
    for row in rows.values():
        assert all(len(row["kinds"][k]["samples"]) == 4 for k in kinds)
    assert report["comparison"]["greedy_text_identical_across_infer_modes"] is True
    for label in ("other", "llama-server plain"):  # another engine's text is reported, not required
        assert rows[label]["kinds"]["chat"]["text_same_as_infer_plain"] == "0/4"
    table = (out / "serving-peer.md").read_text()
    assert f"on `{gguf}`; its --spec-type offers: none, draft-simple, ngram-simple, ngram-map-k" in table
    assert "| code-edit | llama-server ngram-simple | peer |" in table and "infer plain vs peer plain" in table


def test_peer_argument_errors_name_the_problem(tmp_path: Path, fake_binary: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    (server, url) = serve_in_thread()
    try:
        base = ["bench", "serving", "--server", url, "--out", str(tmp_path)]
        assert main([*base, "--peer", "llama-server", "--peer-binary", str(fake_binary)]) == 2
        assert "--peer-model" in capsys.readouterr().err
        gguf = tmp_path / "m.gguf"
        gguf.write_bytes(b"GGUF" + bytes(60))
        assert main([*base, "--peer", "llama-server", "--peer-binary", str(fake_binary), "--peer-model", str(gguf),
                     "--peer-modes", "plain", "ngram-mod"]) == 2
        assert "ngram-mod" in capsys.readouterr().err
        assert main([*base, "--peer", "llama-server", "--peer-binary", str(tmp_path / "nowhere"),
                     "--peer-model", str(gguf)]) == 2
        assert "llama-server binary" in capsys.readouterr().err
        assert main([*base, "--peer-server", url, "--replicas", "1"]) == 2
        assert "--replicas" in capsys.readouterr().err
        assert main([*base, "--peer-server", url, "--offline-repeats", "1"]) == 2
        assert "--offline-repeats" in capsys.readouterr().err
    finally:
        stop(server)


def test_a_server_that_drops_the_connection_is_named() -> None:
    from infer.bench.llama_server import free_port

    dead = Target("llama-server ngram-mod", "peer", f"http://127.0.0.1:{free_port()}", "m")  # nothing listens
    with pytest.raises(RuntimeError, match=r"llama-server ngram-mod \(http://127\.0\.0\.1:\d+\): ConnectError"):
        run_requests([dead], {"chat": ["hi"]}, 1, 4, 0.0, 0, False)
