default_scope = 'mmpar'
custom_imports = dict(imports=['tests.data.plan_model'],
                      allow_failed_imports=False)
model = dict(type='PlanToyNet')
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
parallel = dict(model_parallelism=1, pipeline_parallelism=1)
