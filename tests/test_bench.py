"""`kmp bench` and the bench/ scripts: options, target judging, plot, and real quick runs.

The benchmarks are never timed here: the quick runs only check that every part
runs and writes well-formed results.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kmp.commands import bench as bench_cmd

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load(name: str):
    """Import a bench/ script as a module (bench/ is not a package)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _numbers(obj, path=""):
    """Yield (path, value) for every number in a JSON tree."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, int | float):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, f"{path}/{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _numbers(v, f"{path}[{i}]")


def _args(**kw):
    import argparse

    parser = argparse.ArgumentParser()
    bench_cmd.configure(parser)
    argv = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    args = parser.parse_args(argv)
    args.parts = bench_cmd.parse_only(args.only)
    return args


# ------------------------------------------------------------------ command line


def test_parse_only_defaults_aliases_and_order():
    assert bench_cmd.parse_only(None) == bench_cmd.PARTS
    assert bench_cmd.parse_only("memory, scaling") == ("allreduce", "memory")
    assert bench_cmd.parse_only("POLICIES,policy") == ("policies",)
    assert bench_cmd.parse_only("inference") == ("inference", "generation")  # served models
    assert bench_cmd.parse_only("generation") == ("generation",)


@pytest.mark.parametrize("value", ["speed", ",", "memory,gpu"])
def test_parse_only_rejects_unknown_parts(value):
    with pytest.raises(ValueError, match="policies, profile, overhead, allreduce, memory"):
        bench_cmd.parse_only(value)


def test_find_bench_dir_finds_the_checkout_and_explains_a_bad_one(tmp_path):
    assert bench_cmd.find_bench_dir() == BENCH
    assert bench_cmd.find_bench_dir(BENCH) == BENCH
    with pytest.raises(FileNotFoundError, match="--bench-dir"):
        bench_cmd.find_bench_dir(tmp_path)  # an explicit folder never falls back


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be a positive integer"),
        (["--model", "resnet50", "--image-size", "16"], "too small for resnet50"),
        (["--only", "speed"], "unknown part 'speed'"),
        (["--bench-dir", "/nonexistent"], "--bench-dir"),
    ],
)
def test_bad_options_exit_2_with_a_message(argv, message, capsys, monkeypatch):
    from kmp import cli

    def never(*a, **k):  # a bad option must stop before any benchmark starts
        raise AssertionError("the suite was loaded")

    monkeypatch.setattr(bench_cmd, "_load_suite", never)
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_is_a_kmp_command():
    from kmp import cli

    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--quick", "--only", "memory"])
    assert args._run is bench_cmd.run
    assert args.quick and args.only == "memory"


# ------------------------------------------------------------------ plan


def test_plan_passes_the_options_to_each_script():
    suite = _load("suite")
    parts = {p.name: p for p in suite.plan(_args(model="cnn", steps=7, batch=16))}
    assert list(parts) == [
        "policies",
        "profile",
        "overhead",
        "allreduce",
        "memory",
        "states",
        "peers",
        "numerics",
        "inference",
        "generation",
        "engines",
        "checkpoints",
    ]
    assert parts["states"].argv == ("--states", "--steps", "20")  # its own 67M MLP
    assert parts["engines"].argv == ()  # its own jobs: the digits CNN and the GPT
    assert parts["checkpoints"].argv == ()  # its own jobs: the GPT on 2 ranks
    assert parts["peers"].argv == ()  # its own models and sizes (the digits CNN, wide_mlp)
    assert parts["numerics"].argv == ()  # its own workloads (digits, MNIST-1D, the GPT)
    assert parts["inference"].argv == ("--exports",)  # its own models, trained then served
    assert parts["generation"].argv == ()  # its own KerasHub models
    for name, part in parts.items():
        scripts = {"states": "memory.py", "profile": "step_profile.py"}
        scripts["generation"] = "serving_hub.py"
        assert (BENCH / part.script).name == scripts.get(name, f"{name}.py")
        own = ("states", "peers", "numerics", "inference", "generation", "engines")
        if name in (*own, "checkpoints"):
            continue
        argv = list(part.argv)
        assert argv[argv.index("--steps") + 1] == "7"
        assert argv[argv.index("--batch") + 1] == "16"
    assert parts["allreduce"].argv[:2] == ("--models", "cnn")
    assert "--model" in parts["memory"].argv
    assert parts["profile"].argv[:2] == ("--models", "cnn")


def test_find_result_takes_a_part_written_on_the_jax_backend(tmp_path):
    suite = _load("suite")
    assert suite.find_result(tmp_path, "inference") is None
    (tmp_path / "inference_jax.json").write_text("{}")  # KERAS_BACKEND=jax kmp bench
    assert suite.find_result(tmp_path, "inference").name == "inference_jax.json"
    assert suite.find_result(tmp_path, "numerics") is None


def test_plan_quick_keeps_everything_tiny_and_every_model_reaches_the_policies():
    suite = _load("suite")
    quick = {p.name: p for p in suite.plan(_args(quick=True, only="policies,memory"))}
    assert set(quick) == {"policies", "memory"}
    assert "--quick" in quick["policies"].argv and "--quick" in quick["memory"].argv
    for model in ("digits_cnn", "mlp", "resnet50"):
        part = suite.plan(_args(model=model, only="policies"))[0]
        argv = list(part.argv)
        assert argv[argv.index("--models") + 1] == model


def test_every_script_takes_every_model_kmp_bench_offers():
    overhead, allreduce, models = _load("overhead"), _load("allreduce"), _load("models")
    assert set(bench_cmd.MODELS) == set(models.MODELS)
    for name in bench_cmd.MODELS:
        assert overhead.parse_args(["--model", name]).model == name
        assert allreduce.parse_args(["--models", name]).models == [name]


def test_policy_order_varies_between_rounds():
    policies = _load("policies")
    orders = [policies.round_order(r) for r in range(len(policies.POLICIES))]
    for order in orders:
        assert sorted(order) == sorted(policies.POLICIES)
    # every policy starts one round, and no policy always follows the same one
    assert sorted(o[0] for o in orders) == sorted(policies.POLICIES)
    for p in policies.POLICIES:
        before = {o[o.index(p) - 1] for o in orders if o.index(p) > 0}
        assert len(before) > 1, (p, orders)


def test_memory_child_gets_our_options_with_one_policy():
    memory = _load("memory")
    argv = ["--model", "cnn", "--policies", "float32,mixed_float16", "--batch", "8"]
    assert memory.child_argv(argv, "mixed_float16", "/tmp/o.json") == [
        "--model", "cnn", "--batch", "8",
        "--policies", "mixed_float16", "--child-out", "/tmp/o.json",
    ]  # fmt: skip
    assert memory.child_argv(["--policies=float32", "--quick"], "float32", "o") == [
        "--quick", "--policies", "float32", "--child-out", "o",
    ]  # fmt: skip


def test_idle_cpu_is_averaged_over_ranks_then_median_of_rounds():
    allreduce = _load("allreduce")
    rounds = [
        [{"idle_cpu_fraction": 0.10}, {"idle_cpu_fraction": 0.20}],  # mean 0.15
        [{"idle_cpu_fraction": 0.30}, {"idle_cpu_fraction": 0.50}],  # mean 0.40
        [{"idle_cpu_fraction": 0.05}, {"idle_cpu_fraction": 0.05}],  # mean 0.05
    ]
    partial = [[{"idle_cpu_fraction": 0.1}, {}]]
    assert allreduce.combine_idle({"default": rounds, "quick": partial, "none": []}) == {
        "default": 0.15
    }


def test_child_env_sets_results_and_image_size_and_drops_kmp_policy(tmp_path, monkeypatch):
    suite = _load("suite")
    monkeypatch.setenv("KMP_POLICY", "mixed_float16")
    env = suite.child_env(tmp_path, 48)
    assert env["KMP_BENCH_RESULTS"] == str(tmp_path)
    assert env["KMP_BENCH_IMAGE_SIZE"] == "48"
    assert "KMP_POLICY" not in env  # it would override every policy being compared
    assert str(ROOT) in env["PYTHONPATH"].split(os.pathsep)


def test_models_input_shapes_and_the_image_size_variable(monkeypatch):
    models = _load("models")
    assert models.input_shape("digits_cnn") == (8, 8, 1)
    assert models.input_shape("resnet50", 96) == (96, 96, 3)
    assert models.input_shape("mlp") == (784,)  # flattened 28x28
    assert models.input_shape("mlp", 10) == (100,)
    monkeypatch.setenv("KMP_BENCH_IMAGE_SIZE", "40")
    assert models.input_shape("cnn") == (40, 40, 3)
    assert models.input_shape("cnn", 16) == (16, 16, 3)  # an explicit size wins
    with pytest.raises(ValueError, match="at least 32x32"):
        models.input_shape("resnet50", 16)
    with pytest.raises(ValueError, match="digits_cnn, cnn, mlp, wide_mlp, resnet50"):
        models.input_shape("vgg")
    monkeypatch.setenv("KMP_BENCH_IMAGE_SIZE", "big")
    with pytest.raises(ValueError, match="not an integer"):
        models.input_shape("cnn")


def test_bench_modules_import_each_other_without_a_cycle():
    import ast

    names = {p.stem for p in BENCH.glob("*.py")}
    graph = {}
    for path in BENCH.glob("*.py"):
        tree = ast.parse(path.read_text())
        found = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        found |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        graph[path.stem] = found & names - {path.stem}
    assert "targets" in graph["plot"] and "suite" not in graph["plot"]  # plot reads figures only

    def reach(start, node, seen):
        for nxt in graph[node]:
            assert nxt != start, f"bench import cycle through {start} and {node}"
            if nxt not in seen:
                seen.add(nxt)
                reach(start, nxt, seen)

    for name in graph:
        reach(name, name, set())


# ------------------------------------------------------------------ targets

MACHINE = {"cpu": "test CPU", "cores": 2, "avx512_bf16": False, "amx": False}


def _results(auto_policy="float32", bf16=0.3, eff=0.93, ratio=0.991, mem=0.53):
    return {
        "policies": {
            "machine": MACHINE,
            "models": {
                "cnn": {
                    "float32": {"examples_per_s": 100.0, "vs_float32": 1.0, "policy": "float32"},
                    "mixed_bfloat16": {"vs_float32": bf16, "policy": "mixed_bfloat16"},
                    "mixed_float16": {"vs_float32": 0.13, "policy": "mixed_float16"},
                    "auto": {
                        "vs_float32": 0.99 if auto_policy == "float32" else bf16,
                        "policy": auto_policy,
                    },
                    "auto_vs_fastest": 0.99,
                }
            },
        },
        "overhead": {"ratio_best": ratio, "ratio_median_paired": ratio, "policy": "float32"},
        "allreduce": {
            "machine": MACHINE,
            "best_efficiency": {"cnn/float32": {"efficiency": eff, "setting": "tuned"}},
            "allreduce_ms": {
                "tuned": {
                    "cnn": {"bytes/None": 1000, "bytes/fp16": 500, "bytes/bf16": 500},
                }
            },
        },
        "memory": {
            "model": "cnn",
            "batch": 64,
            "policies": {
                p: {
                    "activation_vs_float32": 0.5,
                    "retained_vs_float32": mem,
                    "step_vs_float32": 0.8,
                }
                for p in ("mixed_bfloat16", "mixed_float16")
            },
        },
    }


def test_judge_meets_targets_from_good_figures():
    bench_targets = _load("targets")
    judged = bench_targets.judge(_results(auto_policy="mixed_bfloat16", bf16=2.0))
    results = {t.name: t.result for t in judged}
    assert list(results.values()).count("met") == 7, results
    gpu = next(t for t in judged if "GPU" in t.name)
    assert gpu.result == "not run" and "gpu_resnet50.py" in gpu.why


def test_judge_explains_each_miss():
    bench_targets = _load("targets")
    judged = bench_targets.judge(_results(eff=0.78, ratio=0.95, mem=0.7))
    by = {t.name: t for t in judged}
    auto = by["auto policy vs float32, CNN training throughput"]
    assert auto.result == "missed" and "AVX512_BF16" in auto.why and "0.30x" in auto.why
    overhead = by["kmp.wrap_optimizer overhead vs Keras LossScaleOptimizer"]
    assert overhead.result == "missed" and math.isclose(overhead.value, 0.95)
    assert "+5.0%" in overhead.measured
    scaling = by["2-process weak-scaling efficiency"]
    assert scaling.result == "missed" and "0.78" in scaling.why
    assert "Measured" not in scaling.why  # no figures behind the causes: none claimed
    memory = by["activation memory, mixed_float16 vs float32"]
    assert memory.result == "missed" and "0.50x" in memory.why
    assert by["compressed allreduce bytes vs float32"].result == "met"


def _profiled(model, policy, matmul, cast, op):
    kinds = {"matmul": matmul, "cast": cast, "variables": 0.0, "other": op - matmul - cast}
    return {"model": model, "policy": policy, "op_ms": op, "kinds_ms": kinds}


def test_best_16_bit_target_judges_the_mlp_and_the_gpt_and_quotes_the_profile():
    bench_targets = _load("targets")
    res = _results()
    res["policies"]["machine"] = {**MACHINE, "avx512_bf16": True}
    res["policies"]["models"] = {
        "mlp": {"float32": {"vs_float32": 1.0}, "mixed_bfloat16": {"vs_float32": 1.85},
                "bfloat16": {"vs_float32": 1.6}, "mixed_float16": {"error": "failed"}},
        "gpt": {"float32": {"vs_float32": 1.0}, "mixed_bfloat16": {"vs_float32": 1.2},
                "bfloat16": {"vs_float32": 1.3}},
    }  # fmt: skip
    res["profile"] = {
        "runs": [
            _profiled("gpt", "float32", 60.0, 0.0, 100.0),
            _profiled("gpt", "bfloat16", 30.0, 5.0, 75.0),
        ]
    }
    mlp, gpt = bench_targets.target_best16(res)
    assert mlp.name == "best 16-bit policy vs float32, MLP training throughput (tensorflow)"
    assert mlp.result == "met" and mlp.measured == "1.85x (mixed_bfloat16)"
    assert gpt.result == "missed" and math.isclose(gpt.value, 1.3)
    # products 60 -> 30 ms (2.00x), casts +5, the rest 40 -> 40 ms: Amdahl 1/(0.3 + 0.4)
    assert "matrix products 60.0 -> 30.0 ms (2.00x)" in gpt.why
    assert "casts +5.0 ms" in gpt.why and "40.0 -> 40.0 ms (1.00x)" in gpt.why
    assert "60% of float32's op time" in gpt.why and "at most 1.43x" in gpt.why
    del res["profile"]  # not profiled in this run: the figure alone, no cause claimed
    gpt = bench_targets.target_best16(res)[1]
    assert gpt.why == "bfloat16 ran at 1.30x float32."
    res["policies"]["machine"] = MACHINE  # no native bfloat16
    assert "no native bfloat16" in bench_targets.target_best16(res)[1].why
    res["policies"]["backend"] = "jax"
    res["policies"]["machine"] = {**MACHINE, "avx512_bf16": True}
    gpt = bench_targets.target_best16(res)[1]
    assert gpt.name.endswith("(jax)") and "XLA:CPU" in gpt.why
    assert [t.result for t in bench_targets.target_best16({})] == ["not run", "not run"]


def test_auto_target_names_the_model_when_the_cnn_was_not_run():
    bench_targets = _load("targets")
    res = _results()
    res["policies"]["models"] = {"resnet50": res["policies"]["models"]["cnn"]}
    speed, near = bench_targets.target_auto(res)
    assert speed.name == "auto policy vs float32, resnet50 training throughput"
    assert speed.result == "missed" and math.isclose(speed.value, 0.99)
    assert near.name.endswith("resnet50") and near.result == "met"


def test_bench_digits_cnn_is_the_reference_scripts_model():
    import keras

    models = _load("models")
    assert models.TRAIN_SCRIPT == ROOT / "launch" / "train.py"
    bench_model = models.build("digits_cnn")
    assert bench_model.name == "digits_cnn"
    # launch/train.py's digits CNN: 3 convolutions, a 128-unit dense layer with dropout
    kinds = [type(layer).__name__ for layer in bench_model.layers]
    assert kinds.count("Conv2D") == 3 and "Dropout" in kinds
    assert bench_model.count_params() == 188_234
    keras.backend.clear_session()


def test_the_underflow_readings_cost_is_judged_under_float16_only():
    bench_targets = _load("targets")
    res = _results()
    res["overhead"] |= {"policy": "mixed_float16", "model": "digits_cnn", "rule_ratio": 0.97}
    res["overhead"]["rule_ratio_cpu_median_paired"] = 0.975
    _, reading = bench_targets.target_overhead(res)
    assert reading.result == "missed" and "+3.0%" in reading.measured
    assert "0.970x the overflow-only rule's" in reading.why and "0.975" in reading.why
    res["overhead"]["rule_ratio"] = 0.995
    assert bench_targets.target_overhead(res)[1].result == "met"
    res["overhead"]["policy"] = "float32"  # nothing to read: not judged
    assert bench_targets.target_overhead(res)[1].result == "not run"


def test_scaling_miss_quotes_the_measured_causes():
    bench_targets = _load("targets")
    res = _results(eff=0.6)
    res["allreduce"]["weak_scaling"] = {
        "cnn/float32": {"single_images_per_s": 100.0, "independent_pair_images_per_s": 150.0}
    }
    res["allreduce"]["horovod_idle_cpu_fraction"] = {"default": 0.14, "cycle_5ms": 0.05}
    (t,) = bench_targets.target_scaling(res)
    assert t.result == "missed"
    assert "reached only 0.75 of twice one process" in t.why
    assert "14% (default), 5% (cycle_5ms) of a core" in t.why


def test_judge_marks_parts_that_did_not_run():
    bench_targets = _load("targets")
    judged = bench_targets.judge({})
    assert {t.result for t in judged} == {"not run"}


def test_compression_target_catches_a_wrong_byte_count():
    bench_targets = _load("targets")
    res = _results()
    res["allreduce"]["allreduce_ms"] = {"cnn": {"bytes/None": 1000, "bytes/fp16": 600}}
    (t,) = bench_targets.target_compression(res)
    assert t.result == "missed" and math.isclose(t.value, 0.6)


def test_plot_writes_a_png_with_or_without_results(tmp_path):
    bench_targets, plot = _load("targets"), _load("plot")
    res = _results()
    res["memory"]["policies"]["float32"] = {"activation_vs_float32": 1.0}
    res["engines"] = {
        "runs": [
            {"model": "gpt", "policy": "float32", "engine": e, "rate": r}
            for e, r in (("horovod", 100.0), ("jax", 95.0), ("jax-keras", 40.0))
        ]
    }
    full = plot.plot_summary(res, bench_targets.judge(res), tmp_path / "full.png")
    empty = plot.plot_summary({}, [], tmp_path / "empty.png")
    for path in (full, empty):
        assert path.read_bytes()[:8] == PNG_MAGIC


def _row(workload, policy, seed, value, diff=0.0, skipped=0, scale=1.0):
    metric = "val_loss_nats" if workload == "gpt" else "test_accuracy"
    return {
        "workload": workload, "policy": policy, "seed": seed, "metric": metric,
        "value": value, "skipped_steps": skipped, "loss_scale_end": scale,
        "weights_max_diff": diff, "steps": 10, "speed": 100.0, "speed_unit": "examples/s",
        "curve": [[5, value + 0.5], [10, value]] if workload == "gpt" else [],
    }  # fmt: skip


def test_numerics_aggregates_seeds_and_judges_the_targets():
    numerics = _load("numerics")
    rows = [
        _row("mnist1d", "float32", s, v) for s, v in enumerate((93.0, 94.0, 95.0))
    ] + [
        _row("mnist1d", "mixed_bfloat16", s, v) for s, v in enumerate((93.5, 94.5, 95.5))
    ] + [
        _row("mnist1d", "mixed_float16", s, v, skipped=2, scale=2.0**14)
        for s, v in enumerate((92.0, 93.0, 94.0))
    ] + [
        _row("gpt", "float32", 0, 2.0), _row("gpt", "mixed_float16", 0, 2.03, diff=1e-7),
    ]  # fmt: skip
    table = numerics.aggregate(rows)
    bf16, fp16 = table["mnist1d"]["mixed_bfloat16"], table["mnist1d"]["mixed_float16"]
    assert bf16["mean"] == pytest.approx(94.5) and bf16["std"] == pytest.approx(1.0)
    assert bf16["delta_points"] == pytest.approx(0.5)
    assert fp16["delta_points"] == pytest.approx(-1.0) and fp16["skipped_steps"] == [2, 2, 2]
    assert table["gpt"]["mixed_float16"]["delta_percent"] == pytest.approx(1.5)
    judged = {t["name"]: t for t in numerics.targets(table, rows)}
    assert judged["MNIST-1D CNN, mixed_bfloat16 vs float32 test accuracy (mean of seeds)"]["met"]
    missed = judged["MNIST-1D CNN, mixed_float16 vs float32 test accuracy (mean of seeds)"]
    assert missed["met"] is False and "spread" in missed["why"]
    assert (
        judged["GPT on text, mixed_float16 vs float32 validation loss (mean of seeds)"]["met"]
        is False
    )  # 1.5 % > 1 %
    assert (
        judged["GPT on text, mixed_bfloat16 vs float32 validation loss (mean of seeds)"]["met"]
        is None
    )  # not run
    paper = judged["MNIST-1D CNN test accuracy, every policy (mean of seeds)"]
    assert paper["met"] is False and paper["value"] == pytest.approx(93.0)  # fp16's mean
    assert "not mixed precision's" not in paper["why"]  # float32 reached 94: a policy missed
    same = judged["ranks' weights bit-identical after every run"]
    assert same["met"] is False and same["value"] == 1e-7
    md = numerics.markdown({"machine": {}, "ranks": 2, "seeds": [0, 1, 2], "table": table,
                            "targets": list(judged.values()), "plot": None})  # fmt: skip
    assert "| mnist1d | mixed_float16 | 93 +- 1 | 92 - 94 | -1.00 points | 2, 2, 2 |" in md


def test_serving_hub_judges_issue_57s_targets_from_its_rows():
    hub = _load("serving_hub")

    def export(model, fmt, agree, ratio):
        return {"model": model, "format": fmt, "precision": "float16",
                "top1_agreement": agree, "size_ratio": ratio}  # fmt: skip

    def gen(kind, speed, same=True):
        return {"how": kind, "kind": kind, "tokens_per_s": speed, "same_tokens": same}

    result = {
        "backend": "jax",
        "exports": [export("bert", "onnx", 1.0, 0.509), export("gpt", "litert", 0.985, 0.6),
                    export("bert", "saved_model", 1.0, None)],
        "generation": [gen("keras", 100.0), gen("loop", 86.0), gen("step", 13.0, False)],
        "int8": {"perplexity_diff": 0.0002, "speed_ratio": 0.61},
    }  # fmt: skip
    judged = {t["name"]: t for t in hub.targets(result)}
    assert judged["serving, bert onnx float16 file size vs float32"]["met"] is True
    assert judged["serving, gpt litert float16 top-1 agreement with float32"]["met"] is False
    speed = judged["serving, generation from the exported GPT vs Keras generate, tokens/s"]
    assert speed["value"] == 0.86 and speed["met"] is False and "jax2tf" in speed["why"]
    assert "loop" in speed["measured"]  # the fastest exported path is named
    same = judged["serving, exported greedy tokens identical to Keras generate's (32, float32)"]
    assert same["met"] is False and same["measured"] == "1 of 2 paths"
    assert judged["serving, int8 GPT perplexity vs float32"]["met"] is True
    assert judged["serving, int8 GPT generate vs float32 on JAX, tokens/s"]["met"] is False
    assert len(judged) == 7  # no size target for a GPT, none for a SavedModel
    quick = {**result, "backend": "tensorflow", "exports": [], "int8": None,
             "generation": result["generation"][:2]}  # fmt: skip
    assert [t["met"] for t in hub.targets(quick)] == [False, True]


def test_inference_judges_speed_quality_and_size_from_its_rows():
    inference = _load("inference")

    def row(model, precision, throughput, **extra):
        timing = {"latency_ms": 1.0, "unit": "examples/s", "max_abs_diff": 0.0}
        quality = {"top1_agreement": 1.0}
        return {
            "model": model,
            "precision": precision,
            "throughput": throughput,
            **timing,
            **quality,
            **extra,
        }

    models = [
        {
            "model": "gpt",
            "rows": [
                row("gpt", "float32", 100.0, perplexity=4.0, top1_agreement=1.0),
                row("gpt", "bfloat16", 160.0, perplexity=4.02, top1_agreement=0.97),
                row("gpt", "int8", 120.0, perplexity=4.2, top1_agreement=0.9),
            ],
        },
        {
            "model": "digits_cnn",
            "rows": [
                row("digits_cnn", "float32", 10.0, accuracy=0.95, top1_agreement=1.0),
                row("digits_cnn", "bfloat16", 12.0, accuracy=0.95, top1_agreement=0.985),
                row("digits_cnn", "int8", 11.0, accuracy=0.945, top1_agreement=0.99),
            ],
        },
        {
            "model": "mlp",
            "rows": [
                row("mlp", "onnx-float32", 1.0, size_bytes=1000),
                row("mlp", "onnx-float16", 1.0, size_bytes=505),
                row("mlp", "litert-float32", 1.0, size_bytes=1000),
                {"model": "mlp", "precision": "litert-float16", "error": "ValueError: no"},
            ],
        },
    ]
    result = {"backend": "tensorflow", "machine": {"avx512_bf16": True, "gpus": []}}
    result["models"] = models
    result["ratios"] = inference.ratios(models)
    assert result["ratios"]["gpt"] == {"float32": 1.0, "bfloat16": 1.6, "int8": 1.2}
    judged = {t["name"]: t for t in inference.targets(result)}
    assert len(judged) == 11
    speed = judged["inference, bfloat16 vs float32 throughput, gpt"]
    assert (speed["value"], speed["met"]) == (1.6, True)
    int8 = judged["inference, int8 vs float32 throughput, gpt"]
    assert (int8["value"], int8["met"]) == (1.2, False) and "Eigen" in int8["why"]
    ppl = judged["inference, int8 perplexity vs float32, gpt"]
    assert ppl["met"] is False and ppl["value"] == pytest.approx(0.05)
    agree = judged["inference, bfloat16 top-1 agreement with float32, digits_cnn"]
    assert (agree["value"], agree["met"]) == (0.985, False)
    points = judged["inference, int8 accuracy vs float32, digits_cnn"]
    assert points["met"] is True and points["value"] == pytest.approx(-0.5)
    assert judged["inference, onnx float16 file size vs float32, mlp"]["met"] is True
    assert judged["inference, litert float16 file size vs float32, mlp"]["met"] is None
    assert judged["inference, bfloat16 vs float32 throughput, resnet50"]["met"] is None
    md = inference.markdown(
        {
            **result,
            "backend": "jax",
            "train_policy": "mixed_bfloat16",
            "batch": 64,
            "targets": list(judged.values()),
            "machine": {"cpu": "c", "cores": 2, "date": "d", "gpus": []},
        }
    )
    assert "| gpt | bfloat16 |" in md and "| missed |" in md


def test_numerics_options_are_checked():
    numerics = _load("numerics")
    quick = numerics.parse_args(["--quick"])
    assert quick.seeds == [0] and quick.workloads == ["gpt"]
    assert quick.policies == ["float32", "mixed_float16"]
    for bad in (["--policies", "float8"], ["--workloads", "imagenet"], ["--seeds", ","]):
        with pytest.raises(SystemExit):
            numerics.parse_args(bad)
    argv = numerics.train_args("mnist1d", "mixed_bfloat16", 2, quick=False)
    assert (
        argv[argv.index("--model") + 1] == "mnist1d_cnn" and argv[argv.index("--seed") + 1] == "2"
    )
    assert "--steps-per-epoch" in numerics.train_args("gpt", "float32", 0, quick=True)


def test_master_weights_bench_judges_modes_against_float32(tmp_path):
    mwb = _load("master_weights")
    rows = [_row("digits", "float32", s, v) for s, v in enumerate((97.0, 97.4))] + [
        _row("digits", "bfloat16+kahan", s, v) for s, v in enumerate((97.1, 97.3))
    ] + [
        _row("digits", "bfloat16+stochastic", s, v) for s, v in enumerate((96.0, 96.2))
    ] + [
        _row("digits", "bfloat16+none", s, v, diff=0.5) for s, v in enumerate((90.0, 91.0))
    ]  # fmt: skip
    table = _load("numerics").aggregate(rows)
    judged = {t["name"]: t for t in mwb.targets(table, rows)}
    assert judged["digits CNN, bfloat16 + kahan vs float32 test accuracy (mean of seeds)"]["met"]
    stochastic = judged[
        "digits CNN, bfloat16 + stochastic vs float32 test accuracy (mean of seeds)"
    ]
    assert stochastic["met"] is False and stochastic["value"] == pytest.approx(-1.1)
    assert judged["digits CNN, bfloat16 + none loses against kahan and stochastic"]["met"]
    assert judged["ranks' weights bit-identical after every bfloat16 run"]["met"] is False
    assert (
        judged["GPT on text, bfloat16 + kahan vs float32 validation loss (mean of seeds)"]["met"]
        is None
    )  # not run
    argv = _load("numerics").train_args("digits", "bfloat16+stochastic", 1, quick=True)
    assert argv[argv.index("--policy") + 1] == "bfloat16"
    assert argv[argv.index("--master-weights") + 1] == "stochastic"
    ref = tmp_path / "numerics.json"
    ref.write_text(json.dumps({"rows": [_row("digits", "float32", 0, 97.0),
                                        _row("digits", "mixed_float16", 0, 97.0)]}))  # fmt: skip
    taken = mwb.reference_rows(ref, [], [0], ["digits"])
    assert [(r["policy"], r["source"]) for r in taken] == [("float32", "numerics.json")]
    with pytest.raises(SystemExit):
        mwb.parse_args(["--policies", "bfloat16+fast"])


def test_underflow_bench_judges_kmps_rule_against_float32_beside_keras():
    uf = _load("underflow")
    numerics = _load("numerics")

    def rows(workload, policy, values, skipped=0, speed=100.0, diff=0.0):
        return [
            {**_row(workload, policy, s, v, diff=diff, skipped=skipped), "steps": 3000,
             "speed": speed}
            for s, v in enumerate(values)
        ]  # fmt: skip

    measured = (
        rows("mnist1d_gru", "float32", (88.0, 89.0))
        + rows("mnist1d_gru", "mixed_float16+keras", (86.0, 87.0), speed=100.0)
        + rows("mnist1d_gru", "mixed_float16", (88.0, 88.6), skipped=12, speed=99.5)
        + rows("digits", "float32", (97.0, 97.4))
        + rows("digits", "mixed_float16", (96.0, 96.2), skipped=40, speed=90.0, diff=0.5)
        + rows("digits", "mixed_float16+keras", (96.9, 97.0), speed=100.0)
    )
    table = numerics.aggregate(measured)
    judged = {t["name"]: t for t in uf.targets(table, measured)}
    gru = judged[
        "MNIST-1D GRU, mixed_float16 (kmp's rule) vs float32 test accuracy (mean of seeds)"
    ]
    assert gru["met"] and gru["value"] == pytest.approx(-0.2)
    assert "Keras's rule -2.00" in gru["measured"]  # shown beside, not judged
    digits = judged[
        "digits CNN, mixed_float16 (kmp's rule) vs float32 test accuracy (mean of seeds)"
    ]
    assert digits["met"] is False and "spread" in digits["why"]
    cnn = judged[
        "MNIST-1D CNN, mixed_float16 (kmp's rule) vs float32 test accuracy (mean of seeds)"
    ]
    assert cnn["met"] is None  # not run
    skipped = judged["overflow-skipped steps under kmp's rule, of each run's steps"]
    assert skipped["met"] is False and skipped["value"] == pytest.approx(40 / 3000 * 100, abs=1e-3)
    speed = judged["mixed_float16 speed, kmp's rule vs Keras's rule"]
    assert speed["met"] is False and speed["value"] == pytest.approx(0.9)
    assert "mnist1d_gru 0.995" in speed["measured"] and "digits: 0.900" in speed["why"]
    ranks = judged["ranks' weights bit-identical after every float16 run"]
    assert ranks["met"] is False
    argv = numerics.train_args("mnist1d_gru", "mixed_float16+keras", 1, False, uf.WORKLOADS)
    assert argv[argv.index("--model") + 1] == "mnist1d_gru"
    assert argv[argv.index("--loss-scale-rule") + 1] == "keras"
    assert "--master-weights" not in argv and argv[-2:] == ["--epochs", "75"]
    quick = uf.parse_args(["--quick"])
    assert quick.workload_table is uf.WORKLOADS and quick.workloads == ["mnist1d_gru"]
    with pytest.raises(SystemExit):
        uf.parse_args(["--workloads", "imagenet"])


def test_state_bytes_per_master_weights_config_and_their_targets():
    states = _load("_states")
    figures = {c: states.measure(c, quick=True, steps=1, tf_memory=None)
               for c in ("mixed_bfloat16", "bfloat16+kahan", "bfloat16+stochastic")}  # fmt: skip
    per = {c: f["state_bytes_per_param"] for c, f in figures.items()}
    assert per == pytest.approx({"mixed_bfloat16": 12.0, "bfloat16+kahan": 8.0,
                                 "bfloat16+stochastic": 6.0}, rel=1e-3)  # fmt: skip
    assert figures["bfloat16+kahan"]["slot_dtype"] == "bfloat16"
    checks = [t["met"] for t in states.targets(figures)]
    # the step peak: not measured without TF's allocator; the step times: no plain bfloat16
    assert checks == [True, True, None, None, None]
    figures["bfloat16+kahan"]["state_bytes"] = figures["mixed_bfloat16"]["state_bytes"]
    assert not states.targets(figures)[1]["met"]  # 1.0 > 0.70: judged, not assumed
    figures["mixed_bfloat16"]["step_peak_bytes"] = 1000 * 2**20
    figures["bfloat16+stochastic"]["step_peak_bytes"] = 560 * 2**20
    peak = states.targets(figures)[2]
    assert (peak["met"], peak["measured"]) == (False, "0.560 (560 vs 1,000 MiB)")
    figures["bfloat16+none"] = {"step_seconds": 0.100}
    figures["bfloat16+kahan"]["step_seconds"] = 0.130
    figures["bfloat16+stochastic"]["step_seconds"] = 0.110
    kahan, stochastic = states.targets(figures)[3:]
    assert (kahan["met"], kahan["value"], kahan["why"] != "") == (False, 1.3, True)
    assert (stochastic["met"], stochastic["measured"]) == (True, "1.10x (110 vs 100 ms, medians)")


def test_limits_of_a_job_from_its_traffic_and_link():
    lim = _load("limits")
    assert lim.rate_bits("1gbit") == 1e9 and lim.rate_bits("500mbit") == 5e8
    with pytest.raises(ValueError, match="tc rate"):
        lim.rate_bits("fast")
    assert lim.bytes_sent_per_rank(40e6, 2, "ring_allreduce") == 40e6
    assert lim.bytes_sent_per_rank(30e6, 3, "ring_allreduce") == pytest.approx(40e6)
    assert lim.bytes_sent_per_rank(20e6, 3, "allgather") == 40e6
    assert lim.bytes_sent_per_rank(20e6, 1, "allgather") == 0.0
    assert lim.job_traffic("kmp_fp16_one_bucket", 40e6) == (20e6, "ring_allreduce")
    assert lim.job_traffic("kmp_bf16", 40e6) == (20e6, "allgather")
    assert lim.job_traffic("hvd_tape", 40e6) == (40e6, "ring_allreduce")
    # 2 ranks x batch 32 in 50 ms of compute; 40 MB each at 1 Gbit/s is 320 ms on the wire.
    got = lim.limits(1280.0, 32, 2, 40e6, 1e9)
    assert got["t_compute_s"] == pytest.approx(0.05) and got["t_wire_s"] == pytest.approx(0.32)
    assert got["wire"] == pytest.approx(200.0)
    assert got["non_overlapped"] == pytest.approx(64 / 0.37)
    assert got["overlapped"] == pytest.approx(200.0)


# ------------------------------------------------------------------ memory counting


def test_activation_bytes_halve_under_a_mixed_policy():
    import keras

    import kmp

    memory, models = _load("memory"), _load("models")
    counted = {}
    for policy in ("float32", "mixed_bfloat16"):
        with kmp.policy_scope(policy):
            model = models.build("digits_cnn")
            counted[policy] = memory.activation_bytes(model, batch_size=10)
        del model
        keras.backend.clear_session()
        gc.collect()
    f32, bf16 = counted["float32"], counted["mixed_bfloat16"]
    # conv 8x8x32 + 8x8x64 + pool 4x4x64 + conv 4x4x64 + flatten 1024 + dense 128
    # + dropout 128 + 10 logits (launch/train.py's digits CNN)
    per_example = 8 * 8 * 32 + 8 * 8 * 64 + 3 * 4 * 4 * 64 + 2 * 128 + 10
    assert f32 == {"float32": 10 * per_example * 4}  # float32 already: no extra head
    assert bf16 == {"bfloat16": 10 * per_example * 2, "float32": 10 * 10 * 4}  # + float32 head


# ------------------------------------------------------------------ real quick runs


def _run(cmd, env=None, timeout=900):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    env.pop("KMP_POLICY", None)
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def _signed(part: str, path: str) -> bool:
    """Figures that may be negative: differences from float32 (numerics, inference)."""
    last = path.rsplit("/", 1)[-1]
    if part == "inference":
        return last == "value"  # a target's change in accuracy points or perplexity
    if part == "checkpoints":  # a step time's change against no checkpoints (noise: < 0)
        return last in ("cost", "value")
    return part == "numerics" and last in ("delta_percent", "delta_points", "value")


def _signed_targets(summary: dict) -> list[dict]:
    """Targets whose value is a difference (may be <= 0): numerics' and inference's."""
    names = {"ranks' weights bit-identical after every run"}
    return [
        t
        for t in summary["targets"]
        if t["name"] in names
        or "(mean of seeds)" in t["name"]
        or t["name"].startswith("inference, int8 accuracy")
        or "perplexity vs float32" in t["name"]
        or t["name"].startswith("async step checkpoints")
    ]


@pytest.mark.slow
def test_kmp_bench_quick_writes_well_formed_results(tmp_path):
    out = tmp_path / "results"
    _run([sys.executable, "-m", "kmp.cli", "bench", "--quick", "--out", str(out)])
    summary = json.loads((out / "summary_quick.json").read_text())
    assert summary["quick"] is True
    assert set(summary["parts"]) == set(bench_cmd.PARTS)
    for name, rec in summary["parts"].items():
        assert rec["status"] == "ok", (name, rec)
        payload = json.loads((out / rec["result_file"]).read_text())
        numbers = list(_numbers(payload))
        assert numbers, name
        bad = [(p, v) for p, v in numbers if not math.isfinite(v)]
        bad += [(p, v) for p, v in numbers if v < 0 and not _signed(name, p)]
        assert not bad, (name, bad)
        assert (out / "logs" / f"{name}.log").stat().st_size > 0
    policies = json.loads((out / summary["parts"]["policies"]["result_file"]).read_text())
    for fig in policies["models"]["cnn"].values():
        if isinstance(fig, dict):
            assert fig["examples_per_s"] > 0
    memory = json.loads((out / summary["parts"]["memory"]["result_file"]).read_text())
    for fig in memory["policies"].values():
        assert fig["activation_bytes"] > 0 and fig["retained_bytes"] > 0
        assert fig["step_bytes"] > 0
    assert memory["policies"]["mixed_float16"]["activation_vs_float32"] < 1.0
    targets = {t["name"]: t for t in summary["targets"]}
    assert len(targets) == 44
    measured = [t for t in targets.values() if t["result"] != "not run"]
    # All but the GPU one, the two of the links and the best 16-bit policy's on the MLP and
    # the GPT (the quick policies part trains the CNN only); of the numerics, the
    # GPT under mixed_float16 and the ranks' weights (the quick run has only those); of
    # inference's, those of the digits CNN, the MLP and the GPT in bfloat16 and int8 (not
    # ResNet50's or MNIST-1D's) and both exports' sizes; the engines' on the digits CNN;
    # the five of the states part (state bytes, step peak, step times); the overhead
    # part's two (kmp vs Keras, the underflow reading vs the overflow-only rule); the
    # checkpoints part's two (async cost, signal to checkpoint); the generation part's two
    # (the exported loop's speed against Keras generate, its tokens).
    assert len(measured) == 30, [t["name"] for t in measured]
    peers = json.loads((out / summary["parts"]["peers"]["result_file"]).read_text())
    jobs = peers["local"]["jobs"]
    assert not peers["local"]["errors"]
    for name in ("kmp", "hvd_tape", "mwms"):  # every peer ran, its ranks in sync
        assert jobs[name]["images_per_s"] > 0 and jobs[name]["ranks_identical"], name
        assert 0.0 <= jobs[name]["accuracy"] <= 1.0
    assert peers["cluster"] == {"skipped": "--no-cluster"}
    for t in measured:
        assert math.isfinite(t["value"])
        assert t["value"] > 0 or t in _signed_targets(summary), t
    numerics = json.loads((out / summary["parts"]["numerics"]["result_file"]).read_text())
    assert [(r["workload"], r["policy"]) for r in numerics["rows"]] == [
        ("gpt", "float32"),
        ("gpt", "mixed_float16"),
    ]
    for row in numerics["rows"]:  # real 2-rank runs: in sync, 4 steps, evaluated each epoch
        assert row["weights_max_diff"] == 0 and row["steps"] == 4
        assert [step for step, _ in row["curve"]] == [2, 4]
        assert all(2.0 < loss < 6.0 for _, loss in row["curve"])  # nats/byte, ln 256 = 5.5
    f32, f16 = numerics["rows"]
    assert f32["loss_scale_end"] == 1.0 and f16["loss_scale_end"] >= 2.0**10
    assert (out / "numerics_quick.png").read_bytes()[:8] == PNG_MAGIC
    assert (out / "summary_quick.png").read_bytes()[:8] == PNG_MAGIC
    md = (out / "summary_quick.md").read_text()
    assert "| target | goal | measured | result | why |" in md
    assert md.count("## ") >= 5


@pytest.mark.slow
def test_probe_bench_quick_times_both_backends(tmp_path):
    _run(
        [sys.executable, str(BENCH / "probe.py"), "--quick"],
        env={"KMP_BENCH_RESULTS": str(tmp_path)},
    )
    result = json.loads((tmp_path / "probe_quick.json").read_text())
    assert [r["backend"] for r in result["runs"]] == ["tensorflow", "jax"]
    for run in result["runs"]:
        assert run["train_step_s"] > 0 and run["probe_s"] > 0 and run["finite_values"]
        assert run["layers_probed"] >= 20 and run["recommended_loss_scale"] >= 1
    assert "| tensorflow |" in (tmp_path / "probe_quick.md").read_text()


@pytest.mark.slow
def test_gpu_resnet50_quick_runs_on_jax_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    _run(
        [
            sys.executable,
            str(BENCH / "gpu_resnet50.py"),
            "--quick",
            "--policies",
            "float32,mixed_float16",
            "--out",
            str(out),
        ],
        env={"KERAS_BACKEND": "jax"},
    )
    payload = json.loads(out.read_text())
    assert payload["device"]["backend"] == "jax"
    assert (payload["batch"], payload["image_size"], payload["steps"]) == (4, 32, 2)
    pols = payload["policies"]
    assert set(pols) == {"float32", "mixed_float16"}
    for fig in pols.values():
        assert fig["images_per_s"] > 0 and math.isfinite(fig["final_loss"])
        assert fig["compilations"] in (None, 1)  # the timed steps never recompiled
    assert pols["float32"]["vs_float32"] == 1.0
    assert pols["mixed_float16"]["compute_dtype"] == "float16"
    assert pols["mixed_float16"]["loss_scale"] > 1.0  # dynamic loss scaling ran
    assert pols["float32"]["loss_scale"] == 1.0
    assert out.with_suffix(".md").read_text().startswith("| policy | images/s |")


# ------------------------------------------------------------------ peers (pure parts)


def _peers_result(**cluster_rows):
    row = {"ranks_identical": True}
    return {
        "local": {
            "jobs": {
                "independent_pair": {**row, "images_per_s": 1000.0},
                "kmp": {**row, "images_per_s": 960.0, "vs_limit": 0.96, "accuracy": 0.97},
                "hvd_tape": {**row, "images_per_s": 800.0, "accuracy": 0.97},
                "mwms": {**row, "images_per_s": 1200.0, "accuracy": 0.97},
            },
            "errors": {},
        },
        "cluster": {
            "jobs": {k.replace("__", "/"): {**row, **v} for k, v in cluster_rows.items()},
            "errors": {},
        },
        "machine": {"cpu": "test", "cores": 2, "avx512_bf16": False},
        "load_average": [0.5, 0.5, 0.5],
    }


def test_peer_targets_judge_the_figures_of_the_run():
    report, peers = _load("peers_report"), _load("peers")
    result = _peers_result(**{
        "1gbit__2__kmp": {"images_per_s": 100.0},
        "1gbit__2__kmp_fp16_one_bucket": {"images_per_s": 170.0, "vs_one_bucket": 1.7},
        "1gbit__2__kmp_bucket_4096k": {"images_per_s": 110.0, "vs_one_bucket": 1.1},
        "1gbit__3__kmp_fp16_one_bucket": {"images_per_s": 150.0, "vs_one_bucket": 1.5},
        "1gbit__2__hvd_tape": {"images_per_s": 90.0},
    })  # fmt: skip
    by = {t["name"].split(":")[0]: t for t in report.targets(result, peers.TARGETS)}
    limit = by["one host, 2 ranks"]
    assert (limit["value"], limit["met"]) == (0.96, True)
    peer = by["kmp / each peer that runs (images/s)"]
    assert peer["met"] is False and peer["value"] == 0.8  # mwms was faster on one host
    assert "1 host/mwms" in peer["measured"]
    targets = report.targets(result, peers.TARGETS)
    fp16 = next(t for t in targets if "fp16 compression" in t["name"])
    assert (fp16["value"], fp16["met"]) == (1.5, False)  # the worst host count counts
    assert "1gbit/3/" in fp16["measured"]
    overlap = next(t for t in targets if "overlap" in t["name"])
    assert (overlap["value"], overlap["met"]) == (1.1, False)
    md = report.markdown({**result, "targets": targets})
    assert "| 1gbit | 2 | kmp_fp16_one_bucket | 170.0 | 1.7 |" in md


def test_peer_targets_without_a_cluster_say_why():
    report, peers = _load("peers_report"), _load("peers")
    result = _peers_result()
    result["cluster"] = {"skipped": "not root: kmp cluster needs root"}
    targets = report.targets(result, peers.TARGETS)
    links = [t for t in targets if t["name"].startswith("1 Gbit/s")]
    assert len(links) == 2 and all(t["met"] is None for t in links)
    assert all(t["measured"] == "not root: kmp cluster needs root" for t in links)


def test_engines_table_and_target_put_every_engine_beside_horovod():
    engines = _load("engines")

    def row(model, engine, policy, rate, skipped=0):
        return {"model": model, "engine": engine, "policy": policy, "weights_max_diff": 0.0,
                "skipped_steps": skipped, "quality": 0.96, "rate": rate,
                "unit": "tokens/s" if model == "gpt" else "images/s"}  # fmt: skip

    rows = [
        row("digits_cnn", "horovod", "float32", 2000.0),
        row("digits_cnn", "jax", "float32", 2400.0),
        row("digits_cnn", "jax-keras", "float32", 500.0),
        row("gpt", "horovod", "mixed_float16", 1000.0, 1),
        row("gpt", "jax", "mixed_float16", 850.0, 1),
    ]
    lines = engines.table(rows).splitlines()
    assert lines[0].startswith("| model | policy | engine | weights max diff | skipped steps |")
    assert lines[2] == "| digits_cnn | float32 | horovod | 0 | 0 | 0.9600 | 2000 images/s |  |"
    assert lines[3].endswith("| 2400 images/s | 1.20x |")
    assert lines[4].endswith("| 500 images/s | 0.25x |")
    assert lines[6] == "| gpt | mixed_float16 | jax | 0 | 1 | 0.9600 | 850 tokens/s | 0.85x |"
    # The target reads kmp's step ("jax"), not Keras's ("jax-keras"), per model.
    judged = engines.targets(rows)
    assert [(t["name"], t["value"], t["met"]) for t in judged] == [
        ("JAX engine against the Horovod engine, digits_cnn", 1.2, True),
        ("JAX engine against the Horovod engine, gpt", 0.85, False),
    ]
    assert engines.verdict(judged)[1] == (
        "- JAX engine against the Horovod engine, gpt (>= 0.9x under every policy): **MISSED**, "
        "0.85x (lowest under mixed_float16; mixed_float16 0.85x)"
    )
    machine = {"cpu": "EPYC", "cores": 2, "cpu_flags": ["avx2", "avx512_bf16"], "date": "d"}
    md = engines.render({"machine": machine, "np": 2, "epochs": 6, "runs": rows,
                         "not_run": ["gpt mixed_float16 on jax: why"]})  # fmt: skip
    assert md.startswith("2 processes on EPYC (2 cores; avx2 avx512_bf16), d.")
    assert md.endswith("- not run: gpt mixed_float16 on jax: why")


def test_engine_profile_splits_the_jax_engines_step():
    profile = _load("engine_profile")
    alone = {"images_per_sec": 1000.0}
    jobs = {
        "tf_alone": [alone],
        "jax_alone": [{"images_per_sec": 1200.0, "compiled_step_ms": 5.0}],
        "jax_pair": [{"images_per_sec": 800.0, "compiled_step_ms": 6.0}] * 2,
        "jax_engine": [
            {
                "images_per_sec": 2000.0,
                "fit_ms": 25.0,
                "compiled_step_ms": 22.0,
                "allreduce_ms": 9.0,
                "allreduce_flat_ms": 2.0,
            }
        ],
        "horovod": [{"images_per_sec": 2500.0}],
    }
    split = profile.breakdown(jobs)
    assert split == {"fit_ms": 25.0, "compute_ms": 6.0, "allreduce_ms": 9.0,
                     "allreduce_flat_ms": 2.0, "rest_ms": 7.0, "host_ms": 3.0}  # fmt: skip
    md = profile.table({"policies": {"float32": jobs}, "breakdown": {"float32": split}})
    row = next(line for line in md.splitlines() if line.startswith("| float32 | 1000 |"))
    # images/s per job (the pair summed), then jax/tf, jax engine/horovod, engine/pair, hvd/pair
    assert row == "| float32 | 1000 | 1200 | 1600 | 2000 | 2500 | 1.20 | 0.80 | 1.25 | 1.56 |"
    assert "| float32 | 25.00 | 6.00 | 9.00 | 2.00 | 7.00 | 3.00 |" in md


def test_transformer_bench_counts_each_jobs_bytes_and_limits():
    tr = _load("transformer")
    models = _load("models")
    seq_len, vocab, width, _ = models.TOKEN_MODELS["embed_lm"]
    x, y = models.batch("embed_lm", 4, seed=1)
    assert x.shape == y.shape == (4, seq_len) and x.dtype == "int32"
    assert (x[:, 1:] == y[:, :-1]).all()  # the targets are the next tokens
    params = int(models.build("embed_lm").count_params())
    dense, how = tr.sent_bytes("embed_lm", "kmp_dense", 2)
    assert (dense, how) == (4.0 * params, "ring_allreduce")  # 2 ranks: one payload each way
    assert tr.sent_bytes("embed_lm", "kmp_jax", 2)[0] == dense  # XLA sums dense gradients
    gathered, how = tr.sent_bytes("embed_lm", "kmp", 2)
    rows = tr.BATCH["embed_lm"] * seq_len * (4 * width + tr.INDEX_BYTES)
    assert how == "ring_allreduce + allgather"
    assert gathered == pytest.approx(4.0 * (params - vocab * width) + rows)
    jobs = {
        "1gbit/2/embed_lm/independent": {"images_per_s": 400.0, "ranks_identical": False},
        "1gbit/2/embed_lm/kmp_dense": {"images_per_s": 100.0, "ranks_identical": True},
        "1gbit/2/embed_lm/kmp_jax": {"images_per_s": 90.0, "ranks_identical": True},
    }
    out = tr.derive(jobs)
    row = out["1gbit/2/embed_lm/kmp_dense"]
    assert row["tokens_per_s"] == 100.0 * seq_len
    t_compute, t_wire = 64 / 400.0, dense * 8 / 1e9
    assert row["vs_compute"] == pytest.approx(100.0 / 400.0, abs=1e-3)
    assert row["vs_non_overlapped"] == pytest.approx(100.0 * (t_compute + t_wire) / 64, abs=1e-3)
    assert "vs_compute" not in out["1gbit/2/embed_lm/kmp_jax"]  # no JAX compute limit measured


def test_step_profile_sums_op_time_per_kind_and_compares_with_float32():
    prof = _load("step_profile")
    assert [prof.op_kind(t) for t in ("_MklMatMul", "_MklEinsum", "Cast", "IDLE")] == [
        "matmul", "matmul", "cast", None]  # fmt: skip
    assert prof.op_kind("AssignSubVariableOp") == "variables" and prof.op_kind("Erfc") == "other"
    rows = [{"type": "IDLE", "total_self_time": 9e6},  # idle time is not op time
            {"type": "_MklMatMul", "total_self_time": 30000.0},
            {"type": "Cast", "total_self_time": 10000.0},
            {"type": "Mul", "total_self_time": 10000.0}]  # fmt: skip
    split = prof.split_by_kind(rows, steps=10)
    assert split["op_ms"] == 5.0
    assert split["kinds_ms"] == {"matmul": 3.0, "cast": 1.0, "variables": 0.0, "other": 1.0}
    assert split["top_types"][0] == ["_MklMatMul", 0.6]
    base = {"model": "mlp", "policy": "float32", "wall_ms": 10.0, "op_ms": 8.0,
            "kinds_ms": {"matmul": 6.0, "cast": 0.0, "variables": 1.0, "other": 1.0},
            "top_types": [["_MklMatMul", 0.75]]}  # fmt: skip
    mixed = {"model": "mlp", "policy": "mixed_bfloat16", "wall_ms": 8.0, **split}
    machine = {"cpu": "EPYC", "cores": 2, "cpu_flags": ["avx512_bf16"], "date": "d"}
    md = prof.markdown({"machine": machine, "batch": 64, "steps": 10, "runs": [base, mixed]})
    line = md.splitlines()[3]
    # wall 10/8, op 8/5, matmul 6/3; a cast float32 never ran has no gain to show
    assert line.startswith(
        "| mlp | mixed_bfloat16 | 8.00 (1.25x) | 5.00 (1.60x) | 3.00 (2.00x) | 1.00 |"
    )
