"""Every fenced code block in the README and docs runs as written: ```python blocks execute
in a fresh namespace, ```toml blocks parse."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from flashloop_backend.kernels import KernelProvider, OpName, PagedInputs
from flashloop_backend.kernels.torch_ref.paged import paged_attention

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the package's own fallback
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
PAGED_OPS = {OpName.DENSE_ATTENTION, OpName.DENSE_PREFILL, OpName.SPARSE_PREFILL}


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, first line of the code, code) of every fenced block in ``text``."""
    return [
        (m.group(1).lower(), text.count("\n", 0, m.start(2)) + 1, m.group(2))
        for m in FENCE.finditer(text)
    ]


BLOCKS = [
    pytest.param(lang, code, id=f"{doc.relative_to(REPO)}:{line}:{lang}")
    for doc in DOCUMENTS
    for lang, line, code in fenced_blocks(doc.read_text(encoding="utf-8"))
    if lang in ("python", "toml")
]


def _paged_inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    rows, heads, dim, blocks, block_size = 3, 2, 8, 6, 4
    q = torch.randn(rows, heads, dim, generator=gen)
    key_cache = torch.randn(blocks, block_size, heads, dim, generator=gen)
    value_cache = torch.randn(blocks, block_size, heads, dim, generator=gen)
    block_tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    context_lengths = torch.tensor([5, 8, 1], dtype=torch.int32)
    return q, key_cache, value_cache, block_tables, context_lengths


def _check_provider(provider: KernelProvider) -> None:
    """A provider a block builds serves its paged ops by the op protocol's contract, called
    as the backend calls it: through the impl with the op's inputs."""
    inputs = _paged_inputs()
    for op, impl in provider.impls.items():
        if op in PAGED_OPS:
            torch.testing.assert_close(impl(PagedInputs(*inputs)), paged_attention(*inputs))


def run_python_block(code: str, name: str) -> dict:
    """Execute ``code`` alone, then call each function it defines that takes no arguments
    (an entry point's factory): a name missing inside a body fails only when it runs."""
    namespace: dict = {"__name__": "readme_block"}
    exec(compile(code, name, "exec"), namespace)
    for value in list(namespace.values()):
        defined_here = inspect.isfunction(value) and value.__code__.co_filename == name
        if defined_here and not any(
            p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            for p in inspect.signature(value).parameters.values()
        ):
            result = value()
            if isinstance(result, KernelProvider):
                _check_provider(result)
    return namespace


def test_the_docs_have_blocks_to_run():
    assert any(p.values[0] == "python" for p in BLOCKS)
    assert any(p.values[0] == "toml" for p in BLOCKS)


@pytest.mark.parametrize(("lang", "code"), BLOCKS)
def test_block_runs_as_written(lang, code, request):
    if lang == "toml":
        tomllib.loads(code)
    else:
        run_python_block(code, request.node.callspec.id)


def test_a_broken_block_fails():
    factory = "def provider():\n    return my_fn\n"  # my_fn is never defined
    with pytest.raises(NameError, match="my_fn"):
        run_python_block(factory, "broken-block")
    with pytest.raises(ImportError):
        run_python_block("from flashloop_backend.kernels import NoSuchName\n", "broken-import")
    wrong = (
        "import torch\n"
        "from flashloop_backend.capabilities import Support\n"
        "from flashloop_backend.kernels import KernelImpl, KernelProvider, OpName\n"
        "def provider():\n"
        "    support = Support(devices=frozenset({'cpu'}), dtypes=frozenset({torch.float32}))\n"
        "    impl = KernelImpl(OpName.DENSE_ATTENTION, lambda q, *rest: q * 0, support)\n"
        "    return KernelProvider('x', '1', {OpName.DENSE_ATTENTION: impl})\n"
    )
    with pytest.raises(AssertionError):
        run_python_block(wrong, "wrong-kernel")
    with pytest.raises(tomllib.TOMLDecodeError):
        tomllib.loads('[project.entry-points."flashloop_backend.kernels"\nx = 1\n')
