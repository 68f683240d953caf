"""Sphinx configuration of the course website: the stored notebooks rendered as pages, nothing executed.

`make site` (tools/build_site.py) stages the lessons, the glossary, the exercise notebooks and index.md in
_build/src (never solutions/) and builds _build/html with -W: any warning fails the build.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the course's own extensions below

project = "gpipe_ref course"
author = "the gpipe_ref authors"
copyright = "the gpipe_ref authors, MIT licence"
extensions = ["myst_nb", "glossary_anchors", "notebook_pages", "exercise_cases"]

root_doc = "index"
# What is a page; solutions/ is never staged, and this pattern list would leave it out if it were.
include_patterns = ["index.md", "notebooks/*.ipynb", "notebooks/GLOSSARY.md", "exercises/*.ipynb"]
exclude_patterns = ["**/.ipynb_checkpoints", "**/solutions/**"]

# Notebooks: rendered from their stored outputs and saved widget state, never executed.
nb_execution_mode = "off"
nb_merge_streams = True
# The widgets' saved state is drawn by @jupyter-widgets/html-manager's standalone bundle, served from _static
# (tools/vendor_site_assets.py), not from a CDN.
nb_ipywidgets_js = {"vendor/html-manager/embed.js": {}}

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist", "html_image"]
myst_heading_anchors = 3  # GLOSSARY.md#notation links resolve to headings

nitpicky = True

html_theme = "sphinx_book_theme"
html_title = "gpipe_ref course"
html_static_path = ["_static"]
html_css_files = ["site.css"]
# live.js: the "Make it live" buttons under the explorers' saved views; it fetches Pyodide only when one is pressed
html_js_files = [("mathjax2-hub-shim.js", {"priority": 100}), ("live.js", {"type": "module"})]
html_context = {"default_mode": "light"}  # without a mode the theme logs a console error on a first visit
html_theme_options = {
    "show_toc_level": 2,
    "secondary_sidebar_items": {"**": ["page-toc"], "notebooks/GLOSSARY": []},  # the glossary table gets the room
}
mathjax_path = "vendor/mathjax/tex-chtml-full.js"  # MathJax 3.2.2 with every TeX extension, served from _static
