"""The web app (moh_dit.app, `moh-dit app`): what a request returns against the pipeline itself, the
library's messages for bad input, the limits, the Blocks' handler, the command; and, with RUN_SLOW=1,
the page in headless Chromium (Debian's chromium and chromium-driver)."""

import base64
import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from moh_dit import MoHDiTPipeline
from moh_dit.app import MAX_RATIOS, AppLimits, MoHApp, default_limits

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = ["red circle", "green cross", "blue square", "red triangle"]
STEPS = 3


def _tiny(tiny_pipe, **kwargs) -> MoHDiTPipeline:
    """The tests' tiny MoH-DiT (pixel space, 8 x 8, ratios 0.5..1), with class names for four of its ids."""
    pipe = tiny_pipe(**kwargs)
    pipe = MoHDiTPipeline(transformer=pipe.transformer, scheduler=pipe.scheduler, id2label=dict(enumerate(NAMES)))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pixels(path) -> np.ndarray:
    return np.asarray(PIL.Image.open(path).convert("RGB"))


@pytest.fixture(scope="module")
def shared_pipe(tiny_pipe):
    """One tiny pipeline for the tests that do not sample."""
    return _tiny(tiny_pipe)


@pytest.mark.slow
def test_a_request_shows_what_the_pipeline_makes(tiny_pipe, tmp_path):
    pipe = _tiny(tiny_pipe)
    app = MoHApp(pipe, AppLimits(max_images=8, max_steps=10), tmp_path)
    result = app.generate(["Blue Square", "1"], first_seed=5, seeds_per_class=2, guidance_scale=2.0,
                          num_inference_steps=STEPS, ratios=[0.5, "linear:0.5:1.0"])
    assert result.settings["seeds"] == [5, 6] and [c["id"] for c in result.settings["classes"]] == [2, 1]
    for ratio, shown in zip((0.5, "linear:0.5:1.0"), result.ratios):
        out = pipe([2, 2, 1, 1], guidance_scale=2.0, num_inference_steps=STEPS, head_activation_ratio=ratio,
                   seeds=[5, 6, 5, 6])
        for made, file, big in zip(out.images, shown.images, shown.shown):
            assert np.array_equal(_pixels(file), np.asarray(made))  # the PNG holds the pipeline's pixels
            enlarged = np.repeat(np.repeat(np.asarray(made), result.scale, 0), result.scale, 1)
            assert np.array_equal(_pixels(big), enlarged)  # and the page shows them enlarged, nothing else
        assert shown.head_usage == [u.tolist() for u in out.head_usage]
        assert shown.head_activation_ratio == out.head_activation_ratio
        assert shown.mean_attention_flop_ratio == out.mean_attention_flop_ratio and shown.seconds > 0
        assert PIL.Image.open(shown.figure).size[0] > 200
    assert result.scale == 32 and result.ratios[0].captions[0] == "blue square, seed 5"
    assert result.ratios[1].head_activation_ratios[0] == 0.5 and result.ratios[1].head_activation_ratios[-1] == 1.0
    # The zip: the images as made, the figures and the settings with every number shown.
    with zipfile.ZipFile(result.zip_path) as archive:
        record = json.loads(archive.read("settings.json"))
        names = archive.namelist()
        first = np.asarray(PIL.Image.open(io.BytesIO(archive.read(record["ratios"][0]["images"][0]))))
    assert record == json.loads(json.dumps(result.record))
    assert len([n for n in names if n.endswith(".png") and "head_usage" not in n]) == 8
    assert np.array_equal(first, _pixels(result.ratios[0].images[0]))
    assert record["ratios"][1]["requested"] == "linear:0.5:1.0" and record["num_inference_steps"] == STEPS
    # A new request replaces the previous one's folder: the app's folder does not grow.
    app.generate([0], num_inference_steps=1, ratios=[None])
    assert [p.name for p in tmp_path.iterdir()] == ["request-2"]


@pytest.mark.parametrize("change, match", [
    ({"ratios": [0.75, 0.2]}, r"head_activation_ratio=0\.2 is outside this model's reachable range \[0\.5000"),
    ({"ratios": ["0.2"]}, "reachable range"),
    ({"ratios": ["linear:0.5:0.1"]}, r"schedule 'linear:0\.5:0\.1' asks for"),
    ({"ratios": ["cubic:1"]}, "cubic"),
    ({"classes": ["purple hexagon"]}, "Unknown class name 'purple hexagon'"),
    ({"classes": [17]}, "class id 17 is out of range"),
    ({"classes": []}, "class_labels is empty"),
    ({"guidance_scale": 0.5}, "guidance_scale=0.5"),
    ({"num_inference_steps": 0}, "num_inference_steps must be a positive int"),
    ({"first_seed": None}, "seeds must be ints"),
    ({"scheduler": "euler"}, "Unknown scheduler kind 'euler'"),
    ({"num_inference_steps": 11}, r"num_inference_steps=11 is more than this app's 10 \(max_steps\)"),
    ({"seeds_per_class": 5}, r"makes 20 images .* at most 8 per request \(max_images\)"),
    ({"ratios": [0.5] * (MAX_RATIOS + 1)}, "at most 3"),
])
def test_bad_input_is_refused_with_the_library_message_before_sampling(shared_pipe, tmp_path, change, match):
    saved = shared_pipe.scheduler
    app = MoHApp(shared_pipe, AppLimits(max_images=8, max_steps=10), tmp_path)
    calls = []
    hook = shared_pipe.transformer.register_forward_hook(lambda *args: calls.append(1))
    good = {"classes": [0, 1], "first_seed": 0, "seeds_per_class": 1, "guidance_scale": 1.0,
            "num_inference_steps": 2, "scheduler": "ddim", "ratios": [0.75, 1.0]}
    try:
        with pytest.raises(ValueError, match=match):
            app.generate(**{**good, **change})
    finally:
        hook.remove()
    assert calls == [] and list(tmp_path.iterdir()) == []  # no sampling, nothing written
    assert shared_pipe.scheduler is saved


def test_schedulers_offered_are_the_pipelines_and_make_schedulers(tiny_pipe, tmp_path):
    from diffusers import DDIMScheduler, DPMSolverMultistepScheduler

    pipe = _tiny(tiny_pipe, clip_sample=True)
    app = MoHApp(pipe, AppLimits(4, 10), tmp_path)
    assert [value for _, value in app.scheduler_choices] == ["saved", "ddpm", "ddim", "dpm"]
    assert app.scheduler("saved") is pipe.scheduler
    ddim = app.scheduler("ddim")
    assert isinstance(ddim, DDIMScheduler) and ddim.config.clip_sample  # the saved scheduler's clipping
    assert isinstance(app.scheduler("dpm"), DPMSolverMultistepScheduler)
    images = app.generate([0], num_inference_steps=2, scheduler="ddim", ratios=[1.0]).ratios[0].images
    pipe.scheduler = ddim
    assert np.array_equal(_pixels(images[0]), np.asarray(pipe([0], num_inference_steps=2, head_activation_ratio=1.0,
                                                               seeds=[0]).images[0]))
    # Class choices: every id with its name, and the null class for unconditional samples.
    assert app.class_choices[2] == ("2: blue square", 2) and app.class_choices[5] == ("5", 5)
    assert app.class_choices[-1] == ("10: unconditional", 10)


def test_limits_follow_the_model_and_the_machine(tiny_pipe):
    from moh_dit.models.flops import forward_flops

    pipe = _tiny(tiny_pipe)
    per_step = 2 * forward_flops(pipe.transformer, ratio=1.0)
    assert default_limits(pipe, seconds=1.0, flop_rate=per_step * 3) == AppLimits(max_images=1, max_steps=3)
    assert default_limits(pipe, seconds=10.0, flop_rate=per_step * 100) == AppLimits(max_images=16, max_steps=62)
    assert default_limits(pipe, seconds=1.0, flop_rate=per_step * 1e9) == AppLimits(max_images=16, max_steps=1000)
    # A model with more FLOPs gets less on the same machine.
    bigger = _tiny(tiny_pipe, patch_size=1)  # four times the tokens
    smaller = default_limits(bigger, seconds=10.0, flop_rate=per_step * 100)
    assert smaller.max_images * smaller.max_steps < 16 * 62
    assert isinstance(default_limits(pipe).max_images, int)  # measured on this machine


@pytest.mark.slow
def test_the_blocks_handler_shows_library_errors_and_keeps_serving(tiny_pipe, tmp_path):
    gr = pytest.importorskip("gradio")
    from moh_dit.app import build_app

    pipe = _tiny(tiny_pipe)
    demo = build_app(pipe, title="tiny", limits=AppLimits(8, 10), workdir=tmp_path)
    handler = next(f.fn for f in demo.fns.values() if f.api_name == "generate")
    ratios = [True, 0.75, "", True, 1.0, "", False, 0.5, ""]  # per ratio: use, slider, schedule
    with pytest.raises(gr.Error, match="reachable range"):
        handler([0], 0, 1, 1.0, 2, "saved", *ratios[:2], "0.1", *ratios[3:])
    with pytest.raises(gr.Error, match="Unknown class name 'nothing'"):
        handler(["nothing"], 0, 1, 1.0, 2, "saved", *ratios)
    summary, numbers, download, *panels = handler(["red circle", "3"], 0, 1, 1.0, 2, "saved", *ratios)
    record = json.loads(numbers)
    assert [r["requested"] for r in record["ratios"]] == [0.75, 1.0] and Path(download).suffix == ".zip"
    assert [row[1] for row in summary] == [0.75, 1.0]
    assert len(panels) == 4 * MAX_RATIOS
    assert [p.visible for p in panels[::4]] == [True, True, False]  # the third ratio is off
    assert "realised **0.7500**" in panels[1] and panels[2].columns == 1  # a row per class
    assert [item["caption"] for item in panels[2].value] == ["red circle, seed 0", "red triangle, seed 0"]
    out = pipe([0, 3], guidance_scale=1.0, num_inference_steps=2, head_activation_ratio=0.75, seeds=[0, 0])
    assert record["ratios"][0]["head_usage"] == [u.tolist() for u in out.head_usage]
    # A schedule typed in its box replaces its slider.
    _, numbers, *_ = handler([0], 0, 1, 1.0, 2, "saved", True, 0.75, "linear:0.5:1", False, 1.0, "", False, 0.5, "")
    assert json.loads(numbers)["ratios"][0]["head_activation_ratios"] == [0.5, 1.0]


def test_the_command_imports_neither_torch_nor_gradio_until_it_runs():
    code = "import sys, moh_dit.commands.app; print(sorted({'torch', 'gradio'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_without_gradio_the_command_says_how_to_install_it(load_script, capsys, monkeypatch, tmp_path):
    from moh_dit.app import require_gradio

    monkeypatch.setitem(sys.modules, "gradio", None)  # import gradio -> ImportError
    with pytest.raises(ModuleNotFoundError, match=r'pip install "\.\[app\]"'):
        require_gradio()
    # Before the model is looked at: a missing folder is not what it reports.
    assert load_script("app").cli(["--model", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert '.[app]' in err and "Traceback" not in err and "missing" not in err


def test_the_command_serves_this_machine_only_by_default(tiny_pipe, tmp_path, load_script, monkeypatch, refuses):
    gr = pytest.importorskip("gradio")
    _tiny(tiny_pipe).save_pretrained(tmp_path / "model")
    launched = []
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kwargs: launched.append((self, kwargs)))
    assert load_script("app").cli(["--model", str(tmp_path / "model"), "--max-images", "3", "--max-steps", "7",
                                   "-q"]) == 0
    demo, kwargs = launched[0]
    assert (kwargs["server_name"], kwargs["server_port"], kwargs["share"]) == ("127.0.0.1", 7860, False)
    assert demo.moh_app.limits == AppLimits(3, 7) and demo.moh_app.pipe.id2label == dict(enumerate(NAMES))
    assert load_script("app").cli(["--model", str(tmp_path / "model"), "--share", "--port", "8000", "-q"]) == 0
    assert (launched[1][1]["share"], launched[1][1]["server_port"]) == (True, 8000)
    refuses("app", ["--model", tmp_path / "model", "--max-steps", "0"], "--max-steps: '0': give an int >= 1")
    refuses("app", ["--model", tmp_path / "nowhere"], "nowhere does not exist")


# --------------------------------------------------------------------------------------
# moh-dit export --app: the folder runs as a Gradio app (a Hugging Face Space)
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported_app(tiny_pipe, tmp_path_factory):
    from moh_dit.hub.export import export_pipeline

    root = tmp_path_factory.mktemp("export")
    _tiny(tiny_pipe).save_pretrained(root / "model")
    return export_pipeline(root / "model", root / "moh-dit-tiny", app=True, progress=False)


def test_export_app_writes_a_space(exported_app, tiny_pipe, tmp_path):
    from moh_dit.hub.export import export_pipeline

    out = exported_app
    card = (out / "README.md").read_text()
    header = card.split("---\n")[1]
    assert "sdk: gradio\napp_file: app.py\n" in header and "license: apache-2.0" in header  # a Space's keys
    assert "## App" in card and "- `app.py`" in card and "- `app_moh_dit.py`" in card
    info = json.loads((out / "export_info.json").read_text())
    assert "moh_dit.app" in info["bundled_modules"]["app_moh_dit.py"] and "app_moh_dit.py" in info["code_sha256"]
    app = (out / "app.py").read_text()
    assert "from app_moh_dit import MoHDiTPipeline, build_app" in app and "'moh-dit-tiny'" in app
    compile(app, "app.py", "exec")
    assert "diffusers" in (out / "requirements.txt").read_text().split()
    # Without --app the export is as before.
    _tiny(tiny_pipe).save_pretrained(tmp_path / "model")
    plain = export_pipeline(tmp_path / "model", tmp_path / "plain", progress=False)
    assert not {"app.py", "app_moh_dit.py", "requirements.txt"} & {p.name for p in plain.iterdir()}
    assert "sdk:" not in (plain / "README.md").read_text()


@pytest.mark.slow
def test_the_exported_app_runs_from_the_folder_alone(exported_app):
    """The folder's app.py with moh-dit made unimportable: the bundled code loads the pipeline,
    builds the page and samples what the package's pipeline samples."""
    pytest.importorskip("gradio")
    code = (
        "import json, runpy, sys\n"
        "sys.modules['moh_dit'] = None  # as on a Space, where moh-dit is not installed\n"
        "page = runpy.run_path('app.py')\n"
        "assert page['MoHDiTPipeline'].__module__ == 'app_moh_dit', page['MoHDiTPipeline'].__module__\n"
        "handler = next(f.fn for f in page['demo'].fns.values() if f.api_name == 'generate')\n"
        "_, numbers, download, *_ = handler([2], 7, 1, 1.0, 3, 'saved', True, 0.5, '', False, 1.0, '', False, 1.0, '')\n"
        "import base64, zipfile\n"
        "record = json.loads(numbers)\n"
        "png = zipfile.ZipFile(download).read(record['ratios'][0]['images'][0])  # the app's folder goes at exit\n"
        "print(json.dumps({'record': record, 'png': base64.b64encode(png).decode()}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=exported_app, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    pipe = MoHDiTPipeline.from_pretrained(exported_app)
    out = pipe([2], guidance_scale=1.0, num_inference_steps=3, head_activation_ratio=0.5, seeds=[7])
    assert result["record"]["ratios"][0]["head_usage"] == [u.tolist() for u in out.head_usage]
    image = PIL.Image.open(io.BytesIO(base64.b64decode(result["png"])))
    assert np.array_equal(np.asarray(image), np.asarray(out.images[0]))


# --------------------------------------------------------------------------------------
# In a real browser
# --------------------------------------------------------------------------------------

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
BROWSER_STEPS = 25  # DDPM steps: the demo model's images are clear at 25


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_pipe):
    """``moh-dit app`` in its own process on a free localhost port, on the tests' tiny model (or on
    the pipeline folder MOH_DIT_APP_MODEL names, e.g. the demo's, for the README's screenshot)."""
    pytest.importorskip("gradio")
    model = os.environ.get("MOH_DIT_APP_MODEL")
    if model is None:
        model = tmp_path_factory.mktemp("app") / "model"
        _tiny(tiny_pipe).save_pretrained(model)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    log = tmp_path_factory.mktemp("app-log") / "app.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "moh_dit.commands", "app", "--model", str(model),
                                    "--port", str(port), "--max-images", "16", "--max-steps", "50"],
                                   stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(url, timeout=5).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the app did not start: {log.read_text()[-2000:]}")
                time.sleep(1)
        from moh_dit.sampling.sample import load_pipeline

        pipe = load_pipeline(model)
        pipe.set_progress_bar_config(disable=True)
        yield url, pipe
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()):
        pytest.skip(f"no Chromium: the browser tests need {CHROMIUM} and {CHROMEDRIVER} "
                    "(apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1500"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


class Page:
    """The app's page in the browser, by the elem_ids build_app gives its components."""

    def __init__(self, driver, url):
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys

        self.driver, self.By, self.Keys = driver, By, Keys
        driver.get(url)
        self.wait(lambda: driver.find_elements(By.ID, "generate"), 60, "the page did not load")

    def wait(self, condition, seconds, what):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            found = condition()
            if found:
                return found
            time.sleep(0.25)
        pytest.fail(what)

    def css(self, selector):
        return self.driver.find_elements(self.By.CSS_SELECTOR, selector)

    def pick_classes(self, *names):
        """Empty the class dropdown, then search each name and click its option (or, for a name
        the list does not have, press Enter: the typed text is taken as it is)."""
        while self.css("#classes .token-remove"):
            self.css("#classes .token-remove")[0].click()
        for name in names:
            box = self.css("#classes input")[0]
            box.click()
            box.send_keys(name)
            options = [o for o in self.css("li[data-testid=dropdown-option]")
                       if (o.get_attribute("aria-label") or "").endswith(name)]
            if options:
                options[0].click()
            else:
                box.send_keys(self.Keys.ENTER)
            self.css("#classes input")[0].send_keys(self.Keys.ESCAPE)  # close the list
        return [t.text for t in self.css("#classes .token")]

    def type_into(self, selector, value):
        """Type ``value`` into a box, leave it, and wait until the page's state holds it: a slider's
        number box passes its value to the slider (and to the next request) a moment after it is
        left, and a click on Generate in between sent the old value."""
        box = self.css(selector)[0]
        box.click()
        box.send_keys(self.Keys.CONTROL, "a")
        box.send_keys(self.Keys.DELETE, str(value), self.Keys.TAB)
        slider = self.css(selector.replace("input[type=number]", "input[type=range]")) if "number" in selector else []

        def taken():
            shown = [box.get_attribute("value")] + [r.get_attribute("value") for r in slider]
            try:
                return all(float(v) == float(value) for v in shown) if str(value) else shown[0] == ""
            except (TypeError, ValueError):
                return shown[0] == str(value)

        self.wait(taken, 10, f"{selector} did not take {value!r}")
        time.sleep(0.5)  # the change event's round trip to the server

    def generate(self):
        self.css("#generate")[0].click()

    def numbers(self):
        return self.css("#numbers textarea")[0].get_attribute("value")

    def shown_images(self, index):
        """The pixels of the images ratio ``index`` shows, fetched from their src as the browser does."""
        sources = [img.get_attribute("src") for img in self.css(f"#gallery_{index} img")]
        return [np.asarray(PIL.Image.open(io.BytesIO(urllib.request.urlopen(src).read())).convert("RGB"))
                for src in sources]

    def error(self):
        return " ".join(t.text for t in self.css(".toast-body"))

    def close_errors(self):
        for button in self.css(".toast-close"):
            button.click()


@pytest.mark.slow
def test_the_page_shows_the_pipelines_images_and_head_usage(served, browser, tmp_path):
    url, pipe = served
    page = Page(browser, url)
    names = pipe.id2label or {0: "0", 1: "1"}
    classes = [min(names), max(names)]
    low, high = pipe.transformer.head_activation_range
    shown = page.pick_classes(*(names[i] for i in classes))  # one searched and clicked in the list each
    assert len(shown) == 2 and all(text.endswith(names[i]) for text, i in zip(shown, classes))
    page.type_into("#seeds input[type=number]", 3)
    page.type_into("#steps input[type=number]", BROWSER_STEPS)
    page.type_into("#guidance input", 3)
    page.type_into("#ratio_1 input[type=number]", low)  # ratio 1: the fewest heads; ratio 2: every head
    page.generate()
    page.wait(lambda: len(page.css("#gallery_2 img")) == 6 and page.numbers(), 600, "no images after Generate")
    record = json.loads(page.numbers())
    assert [r["requested"] for r in record["ratios"]] == [low, high]
    for index, ratio in enumerate((low, high)):
        out = pipe([classes[0]] * 3 + [classes[1]] * 3, guidance_scale=3.0, num_inference_steps=BROWSER_STEPS,
                   head_activation_ratio=ratio, seeds=[0, 1, 2] * 2)
        images = page.shown_images(index + 1)
        assert len(images) == 6
        for image, made in zip(images, out.images):
            scale = image.shape[0] // made.height
            assert scale >= 1 and np.array_equal(image, np.repeat(np.repeat(np.asarray(made), scale, 0), scale, 1))
        numbers = record["ratios"][index]
        assert numbers["head_usage"] == [u.tolist() for u in out.head_usage]
        assert (numbers["head_activation_ratio"], numbers["mean_attention_flop_ratio"]) == (
            out.head_activation_ratio, out.mean_attention_flop_ratio)
        assert f"{out.head_activation_ratio:.4f}" in page.css(f"#heading_{index + 1}")[0].text
        assert page.css(f"#usage_{index + 1} img")
    link = page.css("#download a")[0].get_attribute("href")
    with zipfile.ZipFile(io.BytesIO(urllib.request.urlopen(link).read())) as archive:
        assert json.loads(archive.read("settings.json")) == record
    browser.execute_script("window.scrollTo(0, 0)")
    browser.set_window_size(1400, browser.execute_script("return document.body.scrollHeight") + 100)
    browser.save_screenshot(str(tmp_path / "app_demo.png"))  # the README's picture (assets/app_demo.png)
    print(f"screenshot: {tmp_path / 'app_demo.png'}")


@pytest.mark.slow
def test_the_page_shows_the_library_message_and_keeps_serving(served, browser):
    url, pipe = served
    page = Page(browser, url)
    page.pick_classes(pipe.id2label.get(0, "0"))
    page.type_into("#steps input[type=number]", 2)
    page.type_into("#schedule_1 textarea", "0.1")  # a ratio below the model's range
    page.generate()
    assert "outside this model's reachable range" in page.wait(page.error, 120, "no error shown for ratio 0.1")
    page.close_errors()
    page.type_into("#schedule_1 textarea", "")
    page.pick_classes("no such class")
    page.generate()
    assert "Unknown class name 'no such class'" in page.wait(
        lambda: "Unknown class" in page.error() and page.error(), 120, "no error shown for an unknown class")
    page.close_errors()
    page.pick_classes(pipe.id2label.get(1, "1"))
    page.generate()
    page.wait(lambda: len(page.css("#gallery_1 img")) == 2 and page.numbers(), 600, "no images after the errors")
    assert json.loads(page.numbers())["classes"][0]["id"] == 1
