"""Package setup: reads settings.ini like every nbdev 2 project, without pkg_resources."""
from configparser import ConfigParser
import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read('settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']

def reqs(key):
    """The requirements listed under `key` in settings.ini."""
    return cfg.get(key, '').split()

licenses = {'apache2': ('Apache Software License 2.0', 'OSI Approved :: Apache Software License')}
lic = licenses[cfg['license']]

setuptools.setup(
    name=cfg['lib_name'].replace('_', '-'),
    version=cfg['version'],
    description=cfg['description'],
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    author=cfg['author'],
    author_email=cfg['author_email'],
    license=lic[0],
    url=cfg['git_url'],
    keywords=cfg['keywords'],
    classifiers=['Programming Language :: Python :: 3', 'License :: ' + lic[1],
                 'Development Status :: ' + cfg['status'] + ' - Alpha'],
    packages=setuptools.find_packages(include=['petite_llm', 'petite_llm.*']),
    include_package_data=True,
    python_requires='>=' + cfg['min_python'],
    install_requires=reqs('requirements'),
    extras_require={
        'hub': reqs('hub_requirements'),
        'dev': reqs('dev_requirements') + reqs('hub_requirements') + [r + "; sys_platform == 'linux'" for r in reqs('linux_requirements')],
    },
    entry_points={'console_scripts': cfg['console_scripts'].split(),
                  'nbdev': [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"]},
    zip_safe=False,
)
