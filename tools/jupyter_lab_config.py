"""JupyterLab's configuration for `make lab`: the course's stored notebooks open read-only.

Running a lesson changes its outputs, and JupyterLab saves them (every two minutes, and on Ctrl+S) into the tracked
file, so a later `git pull` refuses. Here the server reports the lessons, the blank exercises and the solutions as
not writable, so JupyterLab shows them read-only and never autosaves them, and it refuses a save into them, saying
where to save instead. The learner's own folder, work/, is writable as before.
"""

from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager
from tornado import web

READ_ONLY = ("notebooks", "exercises", "solutions")  # folders of the checkout that git tracks


def stored(path: str) -> bool:
    """Whether the API path (relative to the course folder) lies in one of the tracked folders."""
    return path.strip("/").split("/")[0] in READ_ONLY


class StoredNotebooksReadOnly(AsyncLargeFileManager):
    """The server's (default) file manager, with the course's tracked folders read-only."""

    def is_writable(self, path):
        return False if stored(path) else super().is_writable(path)

    async def save(self, model, path=""):
        if stored(path):
            raise web.HTTPError(403, f"{path} is one of the course's stored notebooks and opens read-only, so that "
                                     f"`git pull` keeps working: use File > Save Notebook As... and save your copy "
                                     f"under work/")
        return await super().save(model, path)

    async def rename_file(self, old_path, new_path):
        if stored(old_path) or stored(new_path):
            raise web.HTTPError(403, f"the course's stored folders are read-only: {old_path} stays where it is")
        return await super().rename_file(old_path, new_path)

    async def delete_file(self, path):
        if stored(path):
            raise web.HTTPError(403, f"{path} is one of the course's stored notebooks: it is not deleted")
        return await super().delete_file(path)


c = get_config()  # noqa: F821 (defined by Jupyter when it reads this file)
c.ServerApp.contents_manager_class = StoredNotebooksReadOnly
