"""The web app (moh_dit.app, `moh-dit app`): a request gives the pipeline's own images and numbers,
bad input is the library's one message, the server takes no upload and leaves nothing behind on
SIGTERM; with RUN_SLOW=1 the page in headless Chromium (Debian's chromium and chromium-driver)."""

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from moh_dit import MoHDiTPipeline
from moh_dit.app import build_app, generate

pytestmark = pytest.mark.usefixtures("one_thread")
NAMES = {0: "red circle", 1: "green cross", 2: "blue square"}


@pytest.fixture(scope="module")
def pipe(tiny_pipe):
    """The tests' tiny MoH-DiT (pixel space, 8 x 8, ratios 0.5 to 1) with names for three classes."""
    made = tiny_pipe()
    made = MoHDiTPipeline(transformer=made.transformer, scheduler=made.scheduler, id2label=NAMES)
    made.set_progress_bar_config(disable=True)
    return made


@pytest.mark.slow
def test_a_request_gives_the_pipelines_images_and_numbers(pipe):
    images, record, figure = generate(pipe, ["blue square", "1"], seeds_per_class=2, first_seed=5, guidance_scale=2.0,
                                      num_inference_steps=2, head_activation_ratio=0.5)
    out = pipe([2, 2, 1, 1], guidance_scale=2.0, num_inference_steps=2, head_activation_ratio=0.5, seeds=[5, 6, 5, 6])
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(images, out.images))
    assert record["class_labels"] == [2, 2, 1, 1] and record["seeds"] == [5, 6, 5, 6]
    assert record["head_activation_ratio"] == out.head_activation_ratio == 0.5
    assert record["head_usage"] == [u.tolist() for u in out.head_usage] and 0 < record["attention_flops_vs_dense"] < 1
    assert figure is not None


@pytest.mark.parametrize("change", [{"head_activation_ratio": 0.1}, {"classes": ["purple hexagon"]},
                                    {"num_inference_steps": 11}, {"seeds_per_class": 5}])
def test_bad_input_is_refused_before_sampling(pipe, change):
    calls = []
    hook = pipe.transformer.register_forward_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError):
            generate(pipe, **{"classes": [0, 1], "num_inference_steps": 2, "max_images": 8, "max_steps": 10, **change})
    finally:
        hook.remove()
    assert calls == []


@pytest.mark.slow
def test_the_page_handler_shows_library_errors_and_the_pipelines_pixels(pipe):
    gr = pytest.importorskip("gradio")
    demo = build_app(pipe, title="tiny", max_images=8, max_steps=10)
    handler = next(f.fn for f in demo.fns.values() if f.api_name == "generate")
    with pytest.raises(gr.Error, match="0.1"):
        handler([0], 1, 0, 1.0, 2, 0.1)
    shown, summary, figure, numbers = handler(["red circle", "2"], 1, 3, 1.0, 2, 0.75)
    out = pipe([0, 2], guidance_scale=1.0, num_inference_steps=2, head_activation_ratio=0.75, seeds=[3, 3])
    for (image, caption), made in zip(shown, out.images):
        scale = image.width // made.width
        assert scale > 1 and np.array_equal(np.asarray(image), np.asarray(made.resize(image.size, PIL.Image.NEAREST)))
    assert [caption for _, caption in shown] == ["red circle, seed 3", "blue square, seed 3"]
    assert json.loads(numbers)["head_activation_ratio"] == 0.75 and "0.7500" in summary


@pytest.fixture(scope="module")
def served(tmp_path_factory, pipe):
    """``moh-dit app`` in a process of its own on a free port, its temporary files under ``tmp``."""
    pytest.importorskip("gradio")
    root = tmp_path_factory.mktemp("app")
    pipe.save_pretrained(root / "model")
    (root / "tmp").mkdir()
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRADIO_ANALYTICS_ENABLED": "False", "TMPDIR": str(root / "tmp")}
    process = subprocess.Popen([sys.executable, "-m", "moh_dit.commands", "app", "--model", str(root / "model"),
                                "--port", str(port), "--max-steps", "50"], stdout=open(root / "app.log", "w"),
                               stderr=subprocess.STDOUT, env=env)
    url, deadline = f"http://127.0.0.1:{port}/", time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).close()
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, (root / "app.log").read_text()[-2000:]
            time.sleep(1)
    yield url, process, root / "tmp"
    process.kill()


# ----- in a real browser ------------------------------------------------------------------------

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


@pytest.mark.slow
def test_the_page_in_a_browser(served, pipe):
    if not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()):
        pytest.skip("the browser test needs Debian's chromium and chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("headless=new", "no-sandbox", "disable-dev-shm-usage", "window-size=1400,1400"):
        options.add_argument(f"--{argument}")
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    css = lambda selector: driver.find_elements(By.CSS_SELECTOR, selector)  # noqa: E731

    def wait(condition, what, seconds=300):
        deadline = time.monotonic() + seconds
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.25)

    try:
        driver.get(served[0])
        wait(lambda: css("#generate"), "the page did not load")
        box = css("#ratio input[type=number]")[0]
        box.send_keys(Keys.CONTROL, "a")  # the modifier stays down until the call ends
        box.send_keys(Keys.DELETE, "0.5", Keys.TAB)
        # the number box passes its value to the slider a moment after it is left
        wait(lambda: float(css("#ratio input[type=range]")[0].get_attribute("value")) == 0.5, "ratio not taken", 10)
        time.sleep(0.5)
        css("#generate")[0].click()
        wait(lambda: len(css("#gallery img")) == 4 and css("#numbers textarea")[0].get_attribute("value"), "no images")
        record = json.loads(css("#numbers textarea")[0].get_attribute("value"))
        out = pipe([0, 0, 1, 1], num_inference_steps=50, head_activation_ratio=0.5, seeds=[0, 1, 0, 1])
        assert record["head_activation_ratio"] == 0.5 and record["head_usage"] == [u.tolist() for u in out.head_usage]
        for img, made in zip(css("#gallery img"), out.images):
            shown = PIL.Image.open(io.BytesIO(urllib.request.urlopen(img.get_attribute("src")).read())).convert("RGB")
            assert np.array_equal(np.asarray(shown), np.asarray(made.resize(shown.size, PIL.Image.NEAREST)))
    finally:
        driver.quit()


@pytest.mark.slow
def test_the_server_takes_no_upload_and_cleans_up_on_sigterm(served):  # last: it stops the server
    url, process, tmp = served
    body = (b'--x\r\nContent-Disposition: form-data; name="files"; filename="a.bin"\r\n\r\n' + b"0" * 4096
            + b"\r\n--x--\r\n")
    request = urllib.request.Request(url + "gradio_api/upload", data=body, method="POST",
                                     headers={"Content-Type": "multipart/form-data; boundary=x"})
    with pytest.raises(urllib.error.HTTPError, match="413"):
        urllib.request.urlopen(request, timeout=30)
    assert [p.name for p in tmp.iterdir()][0].startswith("moh-dit-app-")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) in (0, 130) and list(tmp.iterdir()) == []
