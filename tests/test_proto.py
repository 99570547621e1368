from pathlib import Path

from pagedserve.v1 import generate

GENERATED = Path(generate.__file__).parent


def test_generated_modules_match_the_protos(tmp_path):
    generate.generate(tmp_path)
    fresh = sorted((tmp_path / "pagedserve" / "v1").iterdir())
    assert [p.name for p in fresh] == sorted(
        p.name for p in GENERATED.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))
    for path in fresh:
        assert path.read_text() == (GENERATED / path.name).read_text(), (
            f"{path.name} is stale: run `make proto` and commit the result")
