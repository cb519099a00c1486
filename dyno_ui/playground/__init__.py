"""The Gradio playground: `ui.mount(app, served)` puts it on the server's app. It talks to the engine
only through the runtime (jobs and `worker.call`); `trace`, `render` and `charts` need no Gradio."""
