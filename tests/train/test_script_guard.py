"""A script that calls edgetrain.train without an ``if __name__ == "__main__":`` guard."""
import subprocess
import sys

SCRIPT = """
import edgetrain
edgetrain.train(dict(devices=2, steps=1, batch_size=8, progress=False, eval=False, throttle=False, timeout=30,
                     output={output!r}))
"""


def test_unguarded_script_is_told_to_add_the_guard(tmp_path):
    script = tmp_path / "noguard.py"
    script.write_text(SCRIPT.format(output=str(tmp_path / "runs")))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("edgetrain.errors.EdgetrainError: device 0 (host) failed: edgetrain.train was called "
                           "while a device process imported your script"), r.stderr[-2000:]
    assert 'if __name__ == "__main__":' in last
    assert "bootstrapping phase" not in r.stderr  # the devices did not get as far as starting runs of their own
    assert len(list((tmp_path / "runs").iterdir())) == 1  # the script's own run directory, no nested ones
