"""An example of a user's own task for ddp-deploy: forecasting multichannel sensor series.

Nothing here is an image, a class or an accuracy: a GRU model, generated time series with noise
added at random, a Huber loss, and mean absolute error and R² as metrics. It runs under every
launcher the trainer supports, unchanged: ``ddp-train --task forecast:Forecast``.
"""

from forecast.task import Forecast, ForecastOptions

__all__ = ["Forecast", "ForecastOptions"]
