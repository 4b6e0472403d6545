"""Entry points: the ``metainfer-gen`` CLI, batch rendering and the Gradio demo."""
