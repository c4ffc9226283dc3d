"""megatron-core's torch.compile decorations wait for the first call (megatron/trainer/lazy_fusions.py)."""

import subprocess
import sys

import pytest
import torch

from megatron.trainer import lazy_fusions

ROOT = __file__.rsplit("/tests/", 1)[0]


class RecordingCompile:
    """Stands in for torch.compile: records what it compiled, returns a marked wrapper."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, **options):
        self.calls.append((model, options))
        return lambda *args, **kwargs: ("compiled", model(*args, **kwargs))


@pytest.fixture
def recording(monkeypatch):
    """torch.compile recorded, and every call taken for one on CUDA tensors."""
    fake = RecordingCompile()
    monkeypatch.setattr(torch, "compile", fake)
    monkeypatch.setattr(lazy_fusions, "on_cuda", lambda args, kwargs: True)
    return fake


def test_cpu_tensors_run_eagerly(monkeypatch):
    fake = RecordingCompile()
    monkeypatch.setattr(torch, "compile", fake)
    bias_gelu = lazy_fusions.compile_on_first_call(lambda bias, y: torch.nn.functional.gelu(y + bias))
    y, bias = torch.randn(3, 4), torch.randn(4)
    assert torch.equal(bias_gelu(bias, y=y), torch.nn.functional.gelu(y + bias))
    assert fake.calls == []
    assert not lazy_fusions.on_cuda((bias, 1), {"y": y})


def test_function_is_compiled_on_its_first_call_with_the_same_options(recording):
    def gelu_sum(x, y):
        return x + y

    deferred = lazy_fusions.compile_on_first_call(gelu_sum)
    assert recording.calls == [] and deferred.__name__ == "gelu_sum"
    assert deferred(1, 2) == ("compiled", 3)
    assert deferred(3, 4) == ("compiled", 7)
    assert recording.calls == [(gelu_sum, {})]  # once, on the first call

    with_options = lazy_fusions.compile_on_first_call(mode="max-autotune", dynamic=False)
    square = with_options(lambda x: x * x)
    assert len(recording.calls) == 1
    assert square(5) == ("compiled", 25)
    assert recording.calls[-1][1] == {"mode": "max-autotune", "dynamic": False}


def test_a_method_binds_its_instance(recording):
    class Router:
        scale = 3

        @lazy_fusions.compile_on_first_call
        def route(self, x):
            return self.scale * x

    assert Router().route(2) == ("compiled", 6)


def test_a_module_is_compiled_at_once(recording):
    layer = torch.nn.Linear(2, 2)
    lazy_fusions.compile_on_first_call(layer, fullgraph=True)
    assert recording.calls == [(layer, {"fullgraph": True})]


@pytest.mark.distributed  # a fresh interpreter: megatron-core imported after the trainer
def test_importing_the_trainer_loads_no_compiler_and_no_wandb_code():
    check = (
        "import sys, torch\n"
        "original = torch.compile\n"
        "import megatron.trainer.training, megatron.trainer.gpt\n"
        "import megatron.core.jit as jit\n"
        "from megatron.trainer.lazy_fusions import compile_on_first_call\n"
        "assert jit.jit_fuser is compile_on_first_call, jit.jit_fuser\n"
        "assert torch.compile is original, 'torch.compile must be restored'\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor')))\n"
        "assert not loaded, loaded[:5]\n"
        "from megatron.core.fusions.fused_bias_geglu import geglu\n"
        "assert geglu.__wrapped__.__module__ == 'megatron.core.fusions.fused_bias_geglu'\n"
        # megatron-core's `import wandb` ran none of wandb's code (lazy_imports)...
        "ran = sorted(m for m in sys.modules if m.startswith('wandb.'))\n"
        "assert 'wandb' in sys.modules and not ran, ran[:5]\n"
        # ... which runs when a name of it is read, as --wandb-project does
        "import wandb\n"
        "assert callable(wandb.init) and 'wandb.sdk' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", check], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
