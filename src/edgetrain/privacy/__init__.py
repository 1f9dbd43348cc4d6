"""What a device's traffic leaks: observers' views of its updates (``observe``), the gradient-inversion attack
on them (``attack``) and how close the reconstructions come to the true images (``metrics``)."""
