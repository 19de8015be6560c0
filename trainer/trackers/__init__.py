"""The experiment trackers, one module each (trainer.tracking is their seam; trainer.seams.TRACKERS names them)."""
