"""Steps padded to CUDA-graph shapes: the buckets, and padded decode and mixed steps run through
the Triton kernels (under the interpreter on a CPU) giving transformers' greedy tokens."""
import pytest
import torch

from pagedserve.executor_svc import model_runner, worker
from pagedserve.executor_svc.attention_backend import TritonAttentionBackend
from pagedserve.executor_svc.cuda_graphs import (MIXED_SPLITS, CudaGraphs, GraphShape, GraphShapes,
                                                 blas_library, bucket, capture_sizes, graph_metadata,
                                                 mixed_capture_sizes)
from pagedserve.executor_svc.step_buffers import StepBuffers
from tests.executor_svc.harness import (NEW_TOKENS, MiniScheduler, Seq, make_worker,
                                                  random_prompts)
from tests.tiny_models import hf_greedy, make_tiny_model


def test_capture_sizes_follow_vllm_buckets():
    sizes = capture_sizes(1024)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]) if b <= 256)
    assert all(b - a == 16 for a, b in zip(sizes, sizes[1:]) if a >= 256)
    assert capture_sizes(100)[-2:] == [96, 100]
    assert capture_sizes(1) == [1]


@pytest.mark.parametrize("num_seqs, size", [(1, 1), (3, 4), (9, 16), (256, 256), (257, 272),
                                            (512, 512), (513, None)])
def test_bucket_is_the_smallest_size_that_fits(num_seqs, size):
    assert bucket(capture_sizes(512), num_seqs) == size


def test_mixed_capture_sizes_step_32_then_64_up_to_the_token_budget():
    assert mixed_capture_sizes(8192) == [32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    assert mixed_capture_sizes(300) == [32, 64, 96, 128, 160, 192, 224, 256, 300]


@pytest.mark.parametrize("num_tokens, num_seqs, shape", [
    (3, 3, GraphShape(4, 4, False)), (9, 9, GraphShape(16, 16, False)), (17, 1, GraphShape(32, 17, True)),
    (33, 16, GraphShape(64, 17, True)), (300, 12, GraphShape(320, 17, True)), (513, 5, None),
    (17, 17, None)])
def test_a_step_pads_to_the_smallest_shape_that_holds_it(num_tokens, num_seqs, shape):
    # max_num_seqs 16: decode steps of up to 16 rows, mixed ones of up to 512 tokens, with room
    # for every sequence and one of padding.
    assert GraphShapes(capture_sizes(16), mixed_capture_sizes(8192), 16).shape(num_tokens, num_seqs) == shape


@pytest.mark.parametrize("shape, num_splits", [(GraphShape(32, 17, True), MIXED_SPLITS),
                                                (GraphShape(64, 17, True), MIXED_SPLITS),
                                                (GraphShape(96, 17, True), 1)])
def test_only_the_smallest_mixed_graphs_split_their_decode_rows_kv(shape, num_splits):
    buffers = StepBuffers.allocate(96, 17, 4, torch.device("cpu"))
    meta = graph_metadata(buffers, shape, max_model_len=64, num_heads=8, num_kv_heads=2, head_dim=16,
                          dtype=torch.float32, kv_dtype=torch.float32)
    assert meta.num_splits == num_splits and meta.max_query_len == shape.num_tokens


def test_blas_library_prefers_cublaslt_up_to_96_tokens(monkeypatch):
    chosen = ["cublas"]

    def preferred(backend=None):
        if backend is not None:
            chosen.append(str(backend))
        return chosen[-1]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    seen = {}
    for num_tokens in (1, 16, 24, 32, 64, 96, 104, 128):
        with blas_library(num_tokens):
            seen[num_tokens] = chosen[-1]
    assert seen == {1: "cublaslt", 16: "cublaslt", 24: "cublaslt", 32: "cublaslt", 64: "cublaslt",
                    96: "cublaslt", 104: "cublas", 128: "cublas"}
    assert chosen[-1] == "cublas"


def test_blas_library_leaves_a_torch_without_cuda_alone(monkeypatch):
    def preferred(backend=None):
        raise AssertionError("a torch without CUDA has no BLAS library to prefer")

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    with blas_library(16):
        pass


def test_capture_fills_the_buffers_with_an_all_padding_step_of_each_shape():
    graphs = CudaGraphs(None, StepBuffers.allocate(64, 17, 4, torch.device("cpu")), {})
    b = graphs.buffers
    for buffer in (b.input_ids, b.positions, b.seq_lens, b.block_tables):
        buffer.fill_(7)
    graphs.fill_padding(GraphShape(8, 8, False))
    assert b.input_ids[:8].eq(0).all() and b.positions[:8].eq(0).all()
    assert b.slot_mapping[:8].eq(-1).all() and b.block_tables[:8].eq(0).all()
    assert b.seq_lens[:8].tolist() == [1] * 8 and b.seq_lens[8] == 7
    # A mixed step: empty sequences, then one that owns every token, without context.
    graphs.fill_padding(GraphShape(32, 17, True))
    assert b.seq_lens.tolist() == [0] * 16 + [32]
    assert b.query_start_loc.tolist() == [0] * 17 + [32]
    assert b.slot_mapping[:32].eq(-1).all() and b.block_tables.eq(0).all()


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="runs the Triton kernels on CPU tensors under TRITON_INTERPRET=1, which is "
                           "set only without a GPU; on a GPU test_gpu_parity covers them")
@pytest.mark.parametrize("enforce_eager, mixed", [(False, False), (False, True), (True, False)],
                         ids=["padded", "mixed", "eager"])
def test_triton_backend_matches_transformers(monkeypatch, tmp_path, enforce_eager, mixed):
    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    monkeypatch.setattr(worker, "get_backend", lambda device: TritonAttentionBackend())
    monkeypatch.setattr(model_runner, "pads_mixed_steps", lambda device: mixed)
    executor = make_worker(path, max_num_seqs=8, enforce_eager=enforce_eager,
                           max_num_batched_tokens=64)
    assert executor.runner.shapes.decode == ([] if enforce_eager else [1, 2, 4, 8])
    assert executor.runner.shapes.mixed == ([32, 64] if mixed else [])
    prompts = random_prompts([3, 20, 9], seed=5)
    scheduler = MiniScheduler(executor, budget=16, seed=5)
    for seq_id, prompt in enumerate(prompts):
        scheduler.add(seq_id, Seq(list(prompt), NEW_TOKENS))
    outputs = scheduler.run_to_completion()
    assert [outputs[i] for i in range(len(prompts))] == hf_greedy(path, prompts, NEW_TOKENS)
