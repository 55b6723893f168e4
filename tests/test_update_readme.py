"""experiments/update_readme.py: the README's suite filter, the generated
suite READMEs and the results index."""

import json
import pathlib

from experiments import update_readme


def _suite(gpu_dir: pathlib.Path, name: str, git: str, shapes=("64x64x64",),
           ladder=False):
  folder = gpu_dir / name
  folder.mkdir(parents=True)
  (folder / "summary.md").write_text(f"table of {name}\n")
  if ladder:
    (folder / "ladder.md").write_text(f"ladder of {name}\n")
  rows = [{"kernel": kernel, "shape": shape, "dtype_label": "bfloat16",
           "layout": "NN", "status": "OK"}
          for shape in shapes for kernel in ("xla", "mosaic/ws_persistent")]
  metadata = {"suite": name, "device": "NVIDIA H200", "driver_version": "580",
              "num_sms": 132, "jax_version": "0.11.2",
              "jaxlib_version": "0.11.2", "git": git,
              "date_utc": "2026-11-22T21:48:37+00:00",
              "command_line": f"python experiments/benchmark.py --suite={name}",
              "timing": "CUPTI", "input_distribution": "normal"}
  (folder / "results.json").write_text(
      json.dumps({"metadata": metadata, "results": rows}))
  return folder


class _Sink:

  def __init__(self):
    self.text = ""

  def write(self, text):
    self.text += text

  def flush(self):
    pass


def test_readme_shows_only_the_named_suites(tmp_path):
  gpu = tmp_path / "results" / "gpu"
  _suite(gpu, "large", "aaa")
  _suite(gpu, "large_tuned", "bbb")
  _suite(gpu, "ladder", "ccc", ladder=True)
  _suite(gpu, "ladder_8192", "ddd", ladder=True)
  readme = tmp_path / "README.md"
  readme.write_text("<!-- BEGIN:results -->\n<!-- END:results -->\n"
                    "<!-- BEGIN:ladder -->\n<!-- END:ladder -->\n")
  assert update_readme.update(readme, gpu, suites=("large",),
                              ladders=("ladder",), out=_Sink()) == 0
  text = readme.read_text()
  assert "table of large" in text and "table of large_tuned" not in text
  assert "ladder of ladder\n" in text and "ladder of ladder_8192" not in text


def test_suite_readme_comes_from_the_metadata(tmp_path):
  gpu = tmp_path / "gpu"
  folder = _suite(gpu, "large", "152ef07", shapes=("64x64x64", "128x64x32"))
  notes = gpu / "mosaic"
  notes.mkdir()
  (notes / "README.md").write_text("# Mosaic notes\n\nsee `../large/`\n")
  (gpu / "other").mkdir()
  (gpu / "other" / "README.md").write_text("# Other\n\nsee `../large_tuned/`\n")
  text = update_readme.suite_readme(folder)
  assert "git sha: 152ef07" in text and "0.11.2 / 0.11.2" in text
  assert "`python experiments/benchmark.py --suite=large`" in text
  assert "2 shape(s)" in text and "4 OK" in text
  assert "[Mosaic notes](../mosaic/README.md)" in text and "Other" not in text
  assert update_readme.write_suite_readmes(gpu) == [folder / "README.md"]
  # Unchanged results write nothing the second time.
  assert update_readme.write_suite_readmes(gpu) == []
  # A README another tool wrote (bench_glu's, bench_moe's) is left alone.
  glu = _suite(gpu, "glu", "5116e4f")
  (glu / "README.md").write_text("# Gated linear unit\n")
  assert update_readme.write_suite_readmes(gpu) == []
  assert (glu / "README.md").read_text() == "# Gated linear unit\n"


def test_results_index_lists_suites_and_notes(tmp_path):
  root = tmp_path / "results"
  _suite(root / "gpu_a", "large", "aaa")
  _suite(root / "gpu_a", "ladder", "bbb", ladder=True)
  (root / "gpu_b" / "multi").mkdir(parents=True)
  (root / "gpu_b" / "multi" / "README.md").write_text("# Two GPUs\n")
  (root / "archive").mkdir()
  (root / "archive" / "INDEX.md").write_text("# Superseded\n")
  index = root / "README.md"
  index.write_text("intro\n<!-- BEGIN:index -->\n<!-- END:index -->\nend\n")
  assert update_readme.update_index(index, root, out=_Sink()) == 0
  text = index.read_text()
  assert "[`large`](gpu_a/large/README.md) | 1 | aaa |" in text
  assert "[ladder.md](gpu_a/ladder/ladder.md)" in text
  assert "[`multi/`](gpu_b/multi/README.md) | Two GPUs |" in text
  assert "archive" not in text.split("BEGIN:index")[1]
  index.write_text("no markers\n")
  assert update_readme.update_index(index, root, out=_Sink()) == 2
  assert index.read_text() == "no markers\n"


def test_another_gpus_folder_leaves_the_top_readme_alone(tmp_path, monkeypatch):
  """The top README shows README_GPU's tables; running the tool for another
  GPU's folder refreshes that folder's READMEs and the index only."""
  monkeypatch.setattr(update_readme, "REPO_ROOT", tmp_path)
  readme = tmp_path / "README.md"
  readme.write_text("<!-- BEGIN:results -->\nold\n<!-- END:results -->\n")
  root = tmp_path / "experiments" / "results"
  (root / "README.md").parent.mkdir(parents=True)
  (root / "README.md").write_text("<!-- BEGIN:index -->\n<!-- END:index -->\n")
  other = root / "nvidia_h100"
  _suite(other, "large", "aaa")
  assert update_readme.main([str(other)]) == 0
  assert readme.read_text() == "<!-- BEGIN:results -->\nold\n<!-- END:results -->\n"
  assert (other / "large" / "README.md").is_file()
  shown = root / update_readme.README_GPU
  _suite(shown, "large", "bbb")
  assert update_readme.main([str(shown)]) == 0
  assert "table of large" in readme.read_text()
